// Native AdamW for the host path: an XLA FFI custom call for the CPU platform.
//
// One pass over a flat subgroup updates the fp32 master weights, m and v in place and
// writes the low-precision parameter copy. The loop is plain C++ that GCC vectorizes;
// it is compiled three times (baseline x86-64, AVX2+FMA, AVX-512) and the widest one
// the CPU supports is picked at run time, so one wheel runs on any x86-64 machine.
// Work is split over std::threads in cache-line aligned chunks.
//
// Results match jax.jit(optax.adamw) on one flat f32 array bit for bit (tested): the
// file is compiled with -ffp-contract=off and every fused multiply-add below is
// explicit, placed where XLA:CPU's LLVM contracts one; divisions by a per-step scalar
// are multiplications by its f32 reciprocal, which is what XLA's algebraic simplifier
// makes of them there; and denormals are flushed to zero as XLA:CPU does while it
// runs. (XLA rewrites differently compiled programs of the same math differently, e.g.
// optax over several leaves; those agree with this kernel to an ulp, not to the bit.)

#ifndef DOS_JAX_NO_PYTHON  // defined by standalone C++ benchmarks of the loop
#include <Python.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "adamw_loop.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dos_jax_host_adamw;  // NOLINT: the loop's internals, this file only

struct Problem {
  ChunkFn fn;
  int64_t size;  // elements per subgroup (the last dimension)
  int64_t total;  // elements over all subgroups (vmap stacks them)
  const float* coeffs;  // kNumSlots per subgroup, or one set for all
  int64_t coeff_stride;
  const int32_t* limits;  // one per subgroup, or one for all
  int64_t limit_stride;
  Pointers in, out;
  size_t mu_bytes;
};

// Copies the state into the outputs when XLA did not alias them (not donated).
void CopyState(const Problem& pb, int64_t begin, int64_t end) {
  auto copy = [&](void* dst, const void* src, size_t bytes) {
    if (dst != src) {
      std::memcpy(static_cast<char*>(dst) + begin * bytes,
                  static_cast<const char*>(src) + begin * bytes, (end - begin) * bytes);
    }
  };
  copy(pb.out.master, pb.in.master, sizeof(float));
  copy(pb.out.mu, pb.in.mu, pb.mu_bytes);
  copy(pb.out.nu, pb.in.nu, sizeof(float));
}

void RunRange(const Problem& pb, int64_t begin, int64_t end) {
  ScopedFlushDenormals flush;
  CopyState(pb, begin, end);
  while (begin < end) {
    const int64_t row = begin / pb.size;
    const int64_t row_start = row * pb.size;
    const int64_t stop = std::min(end, row_start + pb.size);
    const Coeffs c(pb.coeffs + row * pb.coeff_stride);
    const int64_t decay_end = row_start + pb.limits[row * pb.limit_stride];
    Pointers p = pb.out;
    p.grad = pb.in.grad;
    pb.fn(c, p, begin, stop, decay_end);
    begin = stop;
  }
}

ffi::Error AdamWImpl(ffi::Buffer<ffi::F32> master, ffi::AnyBuffer mu,
                     ffi::Buffer<ffi::F32> nu, ffi::AnyBuffer grad,
                     ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::S32> decay_limit,
                     ffi::ResultBuffer<ffi::F32> master_out, ffi::Result<ffi::AnyBuffer> mu_out,
                     ffi::ResultBuffer<ffi::F32> nu_out, ffi::Result<ffi::AnyBuffer> lowp_out,
                     int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = master.dimensions();
  if (dims.size() < 1 || dims.back() < 1) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: master must be non-empty");
  }
  Problem pb;
  pb.size = dims.back();
  pb.total = static_cast<int64_t>(master.element_count());
  const int64_t rows = pb.total / pb.size;
  if (mu.element_count() != master.element_count() ||
      nu.element_count() != master.element_count() ||
      grad.element_count() != master.element_count()) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: state sizes differ");
  }
  const int64_t n_coeffs = static_cast<int64_t>(coeffs.element_count());
  const int64_t n_limits = static_cast<int64_t>(decay_limit.element_count());
  if (n_coeffs != kNumSlots && n_coeffs != kNumSlots * rows) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: bad coefficient vector");
  }
  if (n_limits != 1 && n_limits != rows) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: bad decay_limit");
  }
  if (!ResolveIsa(isa)) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: this CPU lacks the ISA asked for");
  }
  const bool has_lowp = lowp_out->element_count() != 0;
  if (has_lowp && lowp_out->element_count() != master.element_count()) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: bad low-precision output");
  }
  pb.fn = SelectKernel(grad.element_type(), mu.element_type(),
                       has_lowp ? lowp_out->element_type() : ffi::DataType::INVALID,
                       nesterov, isa);
  if (pb.fn == nullptr) {
    return ffi::Error::InvalidArgument("dos_jax_adamw_host: unsupported dtypes");
  }
  pb.coeffs = coeffs.typed_data();
  pb.coeff_stride = n_coeffs == kNumSlots ? 0 : kNumSlots;
  pb.limits = decay_limit.typed_data();
  pb.limit_stride = n_limits == 1 ? 0 : 1;
  pb.in = {master.typed_data(), mu.untyped_data(), nu.typed_data(), grad.untyped_data(),
           nullptr};
  pb.out = {master_out->typed_data(), mu_out->untyped_data(), nu_out->typed_data(),
            nullptr, lowp_out->untyped_data()};
  pb.mu_bytes = ffi::ByteWidth(mu.element_type());

  ParallelFor(pb.total, ThreadsFor(pb.total, num_threads),
              [&pb](int64_t begin, int64_t end) { RunRange(pb, begin, end); });
  return ffi::Error::Success();
}

// A memory-bandwidth probe for benchmarks: the traffic of an AdamW step (read p, m,
// v, g; write p, m, v in place: 28 bytes per element) with next to no arithmetic,
// split over threads like the kernel. Returns the median seconds of `reps` passes.
// Buffers are 2 MiB aligned and advised onto transparent huge pages, as XLA:CPU's
// allocations are (hardware prefetchers stop at page boundaries: 4 KiB pages cost
// streaming code a good share of its bandwidth).
double ProbeSeconds(int64_t n, int64_t threads, int64_t reps) {
  constexpr size_t kHuge = size_t{1} << 21;
  const size_t bytes = (n * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  std::vector<float*> buffers;
  for (int i = 0; i < 4; ++i) {
    auto* b = static_cast<float*>(std::aligned_alloc(kHuge, bytes));
    if (b == nullptr) {
      for (float* f : buffers) std::free(f);
      return -1.0;
    }
#ifdef MADV_HUGEPAGE
    madvise(b, bytes, MADV_HUGEPAGE);
#endif
    std::fill(b, b + n, i == 3 ? 0.f : 1.f);
    buffers.push_back(b);
  }
  auto pass = [&](int64_t begin, int64_t end) {
    float* __restrict pp = buffers[0];
    float* __restrict mm = buffers[1];
    float* __restrict vv = buffers[2];
    const float* __restrict gg = buffers[3];
    for (int64_t i = begin; i < end; ++i) {
      pp[i] += gg[i];
      mm[i] += gg[i];
      vv[i] += gg[i];
    }
  };
  std::vector<double> seconds;
  for (int64_t r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    ParallelFor(n, threads, pass);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  for (float* f : buffers) std::free(f);
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

}  // namespace

// The handler's argument list; `lowp_in` (with Extra) is a dead buffer of the result's
// shape and dtype that XLA aliases to the low-precision result, so it needs no
// fresh allocation (a fresh one costs a page fault per 4 KiB on first touch).
#define DOS_ADAMW_BINDING(...)                                  \
  ffi::Ffi::Bind()                                              \
      .Arg<ffi::Buffer<ffi::F32>>() /* master */                \
      .Arg<ffi::AnyBuffer>() /* mu */                           \
      .Arg<ffi::Buffer<ffi::F32>>() /* nu */                    \
      .Arg<ffi::AnyBuffer>() /* grad */                         \
      .Arg<ffi::Buffer<ffi::F32>>() /* coefficients */          \
      .Arg<ffi::Buffer<ffi::S32>>() /* decay_limit */           \
      __VA_ARGS__                                               \
      .Ret<ffi::Buffer<ffi::F32>>() /* master (aliased) */      \
      .Ret<ffi::AnyBuffer>() /* mu (aliased) */                 \
      .Ret<ffi::Buffer<ffi::F32>>() /* nu (aliased) */          \
      .Ret<ffi::AnyBuffer>() /* low-precision params */         \
      .Attr<int64_t>("num_threads")                             \
      .Attr<bool>("nesterov")                                   \
      .Attr<int64_t>("isa")

ffi::Error AdamWLowpInImpl(ffi::Buffer<ffi::F32> master, ffi::AnyBuffer mu,
                           ffi::Buffer<ffi::F32> nu, ffi::AnyBuffer grad,
                           ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::S32> decay_limit,
                           ffi::AnyBuffer /*lowp_in*/, ffi::ResultBuffer<ffi::F32> master_out,
                           ffi::Result<ffi::AnyBuffer> mu_out,
                           ffi::ResultBuffer<ffi::F32> nu_out,
                           ffi::Result<ffi::AnyBuffer> lowp_out, int64_t num_threads,
                           bool nesterov, int64_t isa) {
  return AdamWImpl(master, mu, nu, grad, coeffs, decay_limit, master_out, mu_out, nu_out,
                   lowp_out, num_threads, nesterov, isa);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHost, AdamWImpl, DOS_ADAMW_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamWHostLowpIn, AdamWLowpInImpl,
                              DOS_ADAMW_BINDING(.Arg<ffi::AnyBuffer>() /* lowp_in */));

#ifndef DOS_JAX_NO_PYTHON
// The Python module: the handlers as capsules for jax.ffi.register_ffi_target, and
// the instruction sets this CPU supports (bit i set = Isa i usable).
DOS_HANDLER_CAPSULE(Handler, DosJaxAdamWHost)
DOS_HANDLER_CAPSULE(HandlerLowpIn, DosJaxAdamWHostLowpIn)

static PyObject* IsaMask(PyObject*, PyObject*) {
  return PyLong_FromLongLong(SupportedIsaMask());
}

static PyObject* Probe(PyObject*, PyObject* args) {
  long long n, threads, reps;
  if (!PyArg_ParseTuple(args, "LLL", &n, &threads, &reps)) return nullptr;
  if (n < 1 || threads < 1 || reps < 1) {
    PyErr_SetString(PyExc_ValueError, "probe_seconds: n, threads and reps must be >= 1");
    return nullptr;
  }
  double seconds;
  Py_BEGIN_ALLOW_THREADS
  seconds = ProbeSeconds(n, threads, reps);
  Py_END_ALLOW_THREADS
  if (seconds < 0) return PyErr_NoMemory();
  return PyFloat_FromDouble(seconds);
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the host AdamW."},
    {"handler_lowp_in", HandlerLowpIn, METH_NOARGS,
     "The same, taking a buffer to alias to the low-precision output."},
    {"isa_mask", IsaMask, METH_NOARGS, "Bit i set: instruction set i is usable here."},
    {"probe_seconds", Probe, METH_VARARGS,
     "probe_seconds(n, threads, reps): median seconds of an AdamW-shaped memory pass."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_adamw",
                              "Native host AdamW (XLA FFI).", -1, kMethods};

PyMODINIT_FUNC PyInit__host_adamw() { return PyModule_Create(&kModule); }
#endif  // DOS_JAX_NO_PYTHON
