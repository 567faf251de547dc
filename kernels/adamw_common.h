// What the native host AdamW's sources share besides the element loop: the
// instruction sets and their run-time choice, one instantiation of a loop per
// instruction set, denormal flushing, and the split of work over threads.
//
// Included (through adamw_loop.h) by host_adamw_rows.cc and host_adamw_disk.cc, and by
// host_isa.cc for SupportedIsaMask; internal to those translation units.

#ifndef DOS_JAX_KERNELS_ADAMW_COMMON_H_
#define DOS_JAX_KERNELS_ADAMW_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define DOS_X86 1
#include <xmmintrin.h>
#else
#define DOS_X86 0
#endif

#define DOS_INLINE inline __attribute__((always_inline))

namespace dos_jax_host_adamw {

// Instruction sets, as the Python side names them (host_adamw.HostIsa).
enum Isa : int64_t { kAuto = 0, kBaseline = 1, kAvx2 = 2, kAvx512 = 3 };

inline int64_t SupportedIsaMask() {
  int64_t mask = 1 << kBaseline;
#if DOS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    mask |= 1 << kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      mask |= 1 << kAvx512;
    }
  }
#endif
  return mask;
}

// Turns kAuto into the widest instruction set this CPU supports; false when `isa`
// names one it lacks.
inline bool ResolveIsa(int64_t& isa) {
  const int64_t mask = SupportedIsaMask();
  if (isa == kAuto) {
    isa = (mask >> kAvx512) & 1 ? kAvx512 : (mask >> kAvx2) & 1 ? kAvx2 : kBaseline;
    return true;
  }
  return (mask >> isa) & 1;
}

// A loop kernel is a class with a static DOS_INLINE `template <bool kNesterov> Run`
// and `Fn`, the function pointer type of Run. One instantiation of Run per instruction
// set: the same source, vectorized for each (Run is compiled inside each target).
template <class Kernel, bool kNesterov, class... Args>
void RunBaseline(Args... args) {
  Kernel::template Run<kNesterov>(args...);
}

#if DOS_X86
template <class Kernel, bool kNesterov, class... Args>
__attribute__((target("avx2,fma,f16c"))) void RunAvx2(Args... args) {
  Kernel::template Run<kNesterov>(args...);
}

template <class Kernel, bool kNesterov, class... Args>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
void RunAvx512(Args... args) {
  Kernel::template Run<kNesterov>(args...);
}
#endif

template <class Kernel, bool kNesterov, class Fn = typename Kernel::Fn>
struct ForIsa;

template <class Kernel, bool kNesterov, class... Args>
struct ForIsa<Kernel, kNesterov, void (*)(Args...)> {
  static auto Pick(int64_t isa) -> void (*)(Args...) {
    switch (isa) {
#if DOS_X86
      case kAvx512: return &RunAvx512<Kernel, kNesterov, Args...>;
      case kAvx2: return &RunAvx2<Kernel, kNesterov, Args...>;
#endif
      default: return &RunBaseline<Kernel, kNesterov, Args...>;
    }
  }
};

// Kernel's Run for `nesterov` and `isa` (a resolved instruction set).
template <class Kernel>
typename Kernel::Fn SelectIsa(bool nesterov, int64_t isa) {
  return nesterov ? ForIsa<Kernel, true>::Pick(isa) : ForIsa<Kernel, false>::Pick(isa);
}

// XLA:CPU runs with denormals flushed to zero (inputs and results); so do we.
class ScopedFlushDenormals {
 public:
#if DOS_X86
  ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~ScopedFlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

// Asks the OS to back the 2 MB-aligned interior of a large output buffer with huge
// pages. XLA hands a custom call a freshly allocated (mmap'ed, never touched) buffer
// for each result it does not alias: its first write faults in every 4 KB page, one
// fault per page (32768 for 128 MB): a quarter of a 64M-parameter update here.
// With transparent huge pages in `madvise` mode (the common default) a 2 MB page
// faults in at once. A hint only: harmless where the pages exist or THP is off.
inline void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

// Work split: at least kMinPerThread elements per thread, chunks of at least kMinChunk
// elements, cache-line aligned, about kChunksPerThread chunks per thread.
constexpr int64_t kAlign = 16;  // elements: one 64-byte line of f32
constexpr int64_t kMinPerThread = int64_t{1} << 15;
constexpr int64_t kMinChunk = int64_t{1} << 14;
constexpr int64_t kChunksPerThread = 16;

// The threads for `total` elements when `num_threads` are allowed.
inline int64_t ThreadsFor(int64_t total, int64_t num_threads) {
  return std::clamp<int64_t>(total / kMinPerThread, 1, std::max<int64_t>(1, num_threads));
}

// Runs fn(begin, end) over [0, total) in chunks taken from a shared counter by
// `threads` threads (a thread slowed by a busy core does not hold up the join).
template <class Fn>
void ParallelFor(int64_t total, int64_t threads, const Fn& fn) {
  const int64_t chunk = std::max(
      kMinChunk, (total / (threads * kChunksPerThread) + kAlign - 1) / kAlign * kAlign);
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < total;) {
      fn(begin, std::min(total, begin + chunk));
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {  // no more threads to be had: go on with fewer
      break;
    }
  }
  work();
  for (auto& w : workers) w.join();
}

}  // namespace dos_jax_host_adamw

// Defines `name`, a Python function (METH_NOARGS) returning the XLA FFI handler symbol
// `handler` as a capsule for jax.ffi.register_ffi_target. Used after Python.h.
#define DOS_HANDLER_CAPSULE(name, handler)                                     \
  static PyObject* name(PyObject*, PyObject*) {                                 \
    return PyCapsule_New(reinterpret_cast<void*>(&handler), nullptr, nullptr); \
  }

#endif  // DOS_JAX_KERNELS_ADAMW_COMMON_H_
