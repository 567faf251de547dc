// Native AdamW over subgroups whose fp32 state lives in files, not in memory: an XLA FFI
// custom call for the CPU platform, the disk tier's update in one call per step.
//
// Subgroup g's state (K rows of S f32: master, mu, nu, as in the stacked state of
// host_adamw_rows.cc) is the file `{directory}/sg{g:06d}.{h}`, row-major (K, S), zero
// padded to a multiple of 4096 bytes, for generation parity h. A call at generation
// `gen` reads parity gen % 2 and writes parity (gen + 1) % 2: each new file is written
// to `{path}.tmp`, fdatasync'ed and renamed over its target, so the current half is
// never modified and a hard link to an older file (a checkpoint) keeps its bytes; after
// the last subgroup the directory is fsync'ed. The update itself is the row loop of the
// in-memory kernel (adamw_rows.h's SelectRows, ParallelFor over each subgroup's S
// elements), so the results are the same bits as `adamw_host_rows` on the same state.
//
// Pipelined over three buffers of one subgroup each: while subgroup j is updated,
// subgroup j + 1 is read by a reader thread and j - 1 written by a writer thread, in
// large pread/pwrite calls (O_DIRECT when asked and the filesystem takes it), so the
// disk's bandwidth bounds the call, not its latency or the update.

#include <Python.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "adamw_loop.h"
#include "adamw_rows.h"
#include "xla/ffi/api/ffi.h"
#include "pjrt_register.h"

namespace ffi = xla::ffi;

namespace {

using namespace dos_jax_host_adamw;  // NOLINT: the shared loop's internals

constexpr char kName[] = "dos_jax_adamw_disk_rows: ";
constexpr size_t kPage = 4096;  // file padding and buffer alignment (O_DIRECT's unit)
constexpr size_t kMaxIo = size_t{64} << 20;  // bytes per pread/pwrite call
constexpr int kShortRead = -1;  // Transfer's answer when a read meets the end of file
constexpr int kBuffers = 3;  // one being read, one updated, one written

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(kName + what);
}

// strerror's text, thread-safe.
std::string ErrorText(int err) { return std::generic_category().message(err); }

// "dos_jax_adamw_disk_rows: cannot <doing> <path>: <strerror>".
std::string IoError(const char* doing, const std::string& path, int err) {
  return std::string(kName) + "cannot " + doing + " " + path + ": " + ErrorText(err);
}

// Subgroup g's file in half `parity`; with `shards` > 1, that of data shard `shard`
// (its columns of the subgroup's rows).
std::string StatePath(std::string_view directory, int64_t g, int64_t parity, int64_t shard,
                      int64_t shards) {
  char name[64];
  if (shards > 1) {
    std::snprintf(name, sizeof(name), "/sg%06lld.s%03lld.%lld", static_cast<long long>(g),
                  static_cast<long long>(shard), static_cast<long long>(parity));
  } else {
    std::snprintf(name, sizeof(name), "/sg%06lld.%lld", static_cast<long long>(g),
                  static_cast<long long>(parity));
  }
  return std::string(directory) + name;
}

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now; 0 or the errno of close (a deferred write error on some filesystems).
  int Close() {
    const int fd = fd_;
    fd_ = -1;
    return fd >= 0 && ::close(fd) != 0 ? errno : 0;
  }

 private:
  int fd_;
};

// open(2), with O_DIRECT when `direct` unless the filesystem refuses it (EINVAL, e.g.
// tmpfs): then buffered. `before_retry` runs between the two tries (a created file may
// have to go first).
template <class BeforeRetry>
int OpenMaybeDirect(const std::string& path, int flags, bool direct,
                    const BeforeRetry& before_retry) {
  flags |= O_CLOEXEC;
  if (direct) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd >= 0 || errno != EINVAL) return fd;
    before_retry();
  }
  return ::open(path.c_str(), flags, 0644);
}

// Reads or writes `bytes` at offset 0 in calls of at most kMaxIo bytes, looping over
// short transfers. Where direct I/O is refused after open (EINVAL: a filesystem that
// takes O_DIRECT only at open, or an unaligned rest after a short transfer), O_DIRECT is
// dropped and the transfer goes on buffered. Returns 0, an errno, or kShortRead.
int Transfer(int fd, char* data, size_t bytes, bool write) {
  size_t done = 0;
  while (done < bytes) {
    const size_t n = std::min(kMaxIo, bytes - done);
    const ssize_t got = write ? ::pwrite(fd, data + done, n, static_cast<off_t>(done))
                              : ::pread(fd, data + done, n, static_cast<off_t>(done));
    if (got < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      const int flags = ::fcntl(fd, F_GETFL);
      if (err == EINVAL && flags >= 0 && (flags & O_DIRECT) &&
          ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) == 0) {
        continue;
      }
      return err;
    }
    if (got == 0) return write ? EIO : kShortRead;
    done += static_cast<size_t>(got);
  }
  return 0;
}

// Reads the whole (padded) file `path` into `data`; '' or the error's one line.
std::string ReadState(const std::string& path, char* data, size_t bytes, bool direct) {
  FileDescriptor fd(OpenMaybeDirect(path, O_RDONLY, direct, [] {}));
  if (fd.get() < 0) return IoError("open", path, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return IoError("stat", path, errno);
  if (static_cast<size_t>(st.st_size) != bytes) {
    return std::string(kName) + path + " has " + std::to_string(st.st_size) +
           " bytes, expected " + std::to_string(bytes) + " (K x S f32, padded to 4096)";
  }
  const int err = Transfer(fd.get(), data, bytes, /*write=*/false);
  if (err == kShortRead) return std::string(kName) + "cannot read " + path + ": file is short";
  if (err != 0) return IoError("read", path, err);
  return "";
}

// Writes `data` (`bytes`, padding included) as the new file `path`: into `path`.tmp (a
// new inode, never a file someone linked), fdatasync'ed, then renamed over `path`.
// '' or the error's one line; on failure the .tmp file is removed.
std::string WriteState(const std::string& path, char* data, size_t bytes, bool direct) {
  const std::string tmp = path + ".tmp";
  auto remove_tmp = [&] { ::unlink(tmp.c_str()); };
  remove_tmp();  // a stale one, left by a call that failed
  FileDescriptor fd(
      OpenMaybeDirect(tmp, O_WRONLY | O_CREAT | O_EXCL, direct, remove_tmp));
  if (fd.get() < 0) return IoError("create", tmp, errno);
  std::string error;
  if (const int err = Transfer(fd.get(), data, bytes, /*write=*/true); err != 0) {
    error = IoError("write", tmp, err);
  } else if (::fdatasync(fd.get()) != 0) {
    error = IoError("sync", tmp, errno);
  } else if (const int close_err = fd.Close(); close_err != 0) {
    error = IoError("close", tmp, close_err);
  } else if (::rename(tmp.c_str(), path.c_str()) != 0) {
    error = IoError("rename", tmp + " to " + path, errno);
  }
  if (!error.empty()) {
    fd.Close();
    remove_tmp();
  }
  return error;
}

std::string SyncDirectory(const std::string& directory) {
  FileDescriptor fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return IoError("open", directory, errno);
  if (::fsync(fd.get()) != 0) return IoError("sync", directory, errno);
  return "";
}

struct FreeAligned {
  void operator()(char* p) const { std::free(p); }
};

// The three stages' progress: subgroups read, updated and written so far, and the
// first failure, which stops every stage.
class Pipeline {
 public:
  // Waits until `ready()` or a failure; false on failure.
  template <class Ready>
  bool Wait(const Ready& ready) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return failed_ || ready(); });
    return !failed_;
  }
  void Advance(int64_t& stage) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stage;
    }
    cv_.notify_all();
  }
  void Fail(const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) error_ = error;
      failed_ = true;
    }
    cv_.notify_all();
  }
  // After the stages have stopped.
  const std::string& error() const { return error_; }
  bool failed() const { return failed_; }

  int64_t read = 0, updated = 0, written = 0;  // guarded by mu_ (read in Wait's ready)

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
  std::string error_;
};

// The reader and writer threads: joined before the call returns, however it returns.
struct Stages {
  explicit Stages(Pipeline& pipe) : pipe(pipe) {}
  ~Stages() {
    if (!threads.empty()) pipe.Fail(std::string(kName) + "stopped");
    Join();
  }
  void Join() {
    for (auto& thread : threads) thread.join();
    threads.clear();
  }
  Pipeline& pipe;
  std::vector<std::thread> threads;
};

ffi::Error DiskImpl(ffi::Buffer<ffi::S32> gen, ffi::Buffer<ffi::S32> shard_in, ffi::AnyBuffer grads,
                    ffi::Buffer<ffi::F32> params, ffi::Buffer<ffi::F32> coeffs,
                    ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32> gen_out,
                    std::string_view directory, ffi::Span<const int64_t> subgroups,
                    int64_t K, int64_t master_k, int64_t mu_k, int64_t nu_k,
                    int64_t decayed_rows, int64_t num_threads, bool nesterov, int64_t isa,
                    bool direct_io, int64_t shards) {
  // Checks, as the in-memory kernel's Prepare makes them.
  if (gen.element_count() != 1 || gen_out->element_count() != 1) {
    return Invalid("gen must be an int32 scalar");
  }
  const int32_t generation = gen.typed_data()[0];
  if (shard_in.element_count() != 1) return Invalid("shard must be an int32 scalar");
  const int64_t shard = shard_in.typed_data()[0];
  if (shards < 1 || shard < 0 || shard >= shards) return Invalid("shard out of range");
  if (generation < 0 || generation == INT32_MAX) return Invalid("gen out of range");
  const auto dims = grads.dimensions();
  if (dims.size() != 2) return Invalid("grads must be (D, S)");
  const int64_t D = dims[0], S = dims[1];
  if (static_cast<int64_t>(subgroups.size()) != D) {
    return Invalid("grads must have one row per subgroup");
  }
  if (static_cast<int64_t>(out->element_count()) != D * S) return Invalid("out must be (D, S)");
  const bool has_master = master_k >= 0;
  if (!has_master && static_cast<int64_t>(params.element_count()) != D * S) {
    return Invalid("params rows are needed without a master slot");
  }
  if (K < 1) return Invalid("K must be positive");
  for (int64_t k : {mu_k, nu_k, has_master ? master_k : mu_k}) {
    if (k < 0 || k >= K) return Invalid("slot index out of range");
  }
  if (mu_k == nu_k || (has_master && (master_k == mu_k || master_k == nu_k))) {
    return Invalid("slots must be distinct");
  }
  if (coeffs.element_count() != kNumSlots) return Invalid("bad coefficient vector");
  {
    std::vector<int64_t> sorted(subgroups.begin(), subgroups.end());
    std::sort(sorted.begin(), sorted.end());
    if (!sorted.empty() &&
        (sorted.front() < 0 || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())) {
      return Invalid("subgroups must be distinct and non-negative");
    }
  }
  if (directory.empty()) return Invalid("directory is empty");
  if (!ResolveIsa(isa)) return Invalid("this CPU lacks the ISA asked for");
  const RowFn fn = SelectRows(grads.element_type(), has_master, out->element_type(),
                              nesterov, isa);
  if (fn == nullptr) return Invalid("unsupported dtypes");

  const size_t state_bytes = static_cast<size_t>(K * S) * sizeof(float);
  const size_t file_bytes = (state_bytes + kPage - 1) / kPage * kPage;
  const int64_t parity = generation % 2, next_parity = (generation + 1) % 2;
  const Coeffs c(coeffs.typed_data());
  const size_t grad_bytes = ffi::ByteWidth(grads.element_type());
  const size_t out_bytes = ffi::ByteWidth(out->element_type());
  auto* grad_base = static_cast<const char*>(grads.untyped_data());
  const float* param_base = params.typed_data();
  auto* out_base = static_cast<char*>(out->untyped_data());
  AdviseHugePages(out_base, out->size_bytes());
  const std::string dir(directory);

  try {
    std::unique_ptr<char, FreeAligned> buffers[kBuffers];
    for (int b = 0; b < std::min<int64_t>(kBuffers, D); ++b) {
      buffers[b].reset(static_cast<char*>(std::aligned_alloc(kPage, file_bytes)));
      if (buffers[b] == nullptr) {
        return ffi::Error::Internal(std::string(kName) + "cannot allocate " +
                                    std::to_string(file_bytes) + " bytes");
      }
      AdviseHugePages(buffers[b].get(), file_bytes);
    }
    auto buffer = [&](int64_t j) { return buffers[j % kBuffers].get(); };

    Pipeline pipe;
    // Subgroup j goes into the buffer of subgroup j - 3, once that one is written.
    auto reader = [&] {
      for (int64_t j = 0; j < D; ++j) {
        if (!pipe.Wait([&] { return pipe.written >= j - (kBuffers - 1); })) return;
        const std::string error =
            ReadState(StatePath(dir, subgroups[j], parity, shard, shards), buffer(j), file_bytes, direct_io);
        if (!error.empty()) return pipe.Fail(error);
        pipe.Advance(pipe.read);
      }
    };
    auto writer = [&] {
      for (int64_t j = 0; j < D; ++j) {
        if (!pipe.Wait([&] { return pipe.updated > j; })) return;
        std::memset(buffer(j) + state_bytes, 0, file_bytes - state_bytes);
        const std::string error = WriteState(StatePath(dir, subgroups[j], next_parity, shard, shards),
                                             buffer(j), file_bytes, direct_io);
        if (!error.empty()) return pipe.Fail(error);
        pipe.Advance(pipe.written);
      }
    };
    // A stage that throws (out of memory) fails the pipeline rather than the process.
    auto guarded = [&pipe](auto stage) {
      return [&pipe, stage] {
        try {
          stage();
        } catch (const std::exception& e) {
          pipe.Fail(std::string(kName) + e.what());
        }
      };
    };
    Stages stages(pipe);
    try {
      stages.threads.emplace_back(guarded(reader));
      stages.threads.emplace_back(guarded(writer));
    } catch (const std::system_error& e) {
      pipe.Fail(std::string(kName) + "cannot start the I/O threads: " + e.what());
    }
    for (int64_t j = 0; j < D; ++j) {
      if (!pipe.Wait([&] { return pipe.read > j; })) break;
      auto* state = reinterpret_cast<float*>(buffer(j));
      RowPointers p{has_master ? state + master_k * S : nullptr, state + mu_k * S,
                    state + nu_k * S, grad_base + j * S * grad_bytes,
                    has_master ? nullptr : param_base + j * S, out_base + j * S * out_bytes};
      const bool decay = subgroups[j] < decayed_rows;
      ParallelFor(S, ThreadsFor(S, num_threads), [&](int64_t begin, int64_t end) {
        ScopedFlushDenormals flush;
        fn(c, p, begin, end, decay);
      });
      pipe.Advance(pipe.updated);
    }
    stages.Join();
    if (pipe.failed()) return ffi::Error::Internal(pipe.error());
    if (D > 0) {
      if (const std::string error = SyncDirectory(dir); !error.empty()) {
        return ffi::Error::Internal(error);
      }
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(kName) + e.what());
  }
  gen_out->typed_data()[0] = generation + 1;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWDiskRows, DiskImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>() /* gen () */
                                  .Arg<ffi::Buffer<ffi::S32>>() /* shard () */
                                  .Arg<ffi::AnyBuffer>() /* grads (D, S) */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* params (D, S) or (0,) */
                                  .Arg<ffi::Buffer<ffi::F32>>() /* coefficients */
                                  .Ret<ffi::AnyBuffer>() /* out (D, S) */
                                  .Ret<ffi::Buffer<ffi::S32>>() /* gen + 1 */
                                  .Attr<std::string_view>("directory")
                                  .Attr<ffi::Span<const int64_t>>("subgroups")
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("master_k")
                                  .Attr<int64_t>("mu_k")
                                  .Attr<int64_t>("nu_k")
                                  .Attr<int64_t>("decayed_rows")
                                  .Attr<int64_t>("num_threads")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("isa")
                                  .Attr<bool>("direct_io")
                                  .Attr<int64_t>("shards"));

DOS_HANDLER_CAPSULE(Handler, DosJaxAdamWDiskRows)


static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS,
     "The XLA FFI handler of the host AdamW over subgroups whose state is in files."},
    DOS_PJRT_METHODS,
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_adamw_disk",
                              "Native host AdamW over subgroup state files (XLA FFI).", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__host_adamw_disk() { return PyModule_Create(&kModule); }
