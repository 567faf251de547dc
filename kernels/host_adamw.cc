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
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define DOS_X86 1
#else
#define DOS_X86 0
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#define DOS_INLINE inline __attribute__((always_inline))

// Slots of the packed f32 coefficient vector (adamw_scalars.Coefficients, in order).
enum Slot {
  kNegLr, kB1, kOneMinusB1, kB2, kOneMinusB2, kEps, kEpsRoot, kWeightDecay,
  kInvBc1, kInvBc2, kGradScale, kInvBc1Next, kNumSlots = 16,
};

struct Coeffs {
  float neg_lr, b1, omb1, b2, omb2, eps, eps_root, wd, inv_bc1, inv_bc2, gscale,
      inv_bc1_next;
  explicit Coeffs(const float* s)
      : neg_lr(s[kNegLr]), b1(s[kB1]), omb1(s[kOneMinusB1]), b2(s[kB2]),
        omb2(s[kOneMinusB2]), eps(s[kEps]), eps_root(s[kEpsRoot]),
        wd(s[kWeightDecay]), inv_bc1(s[kInvBc1]), inv_bc2(s[kInvBc2]),
        gscale(s[kGradScale]), inv_bc1_next(s[kInvBc1Next]) {}
};

// memcpy rather than std::bit_cast / __builtin_bit_cast: any C++17 compiler; it
// compiles to plain register moves and vectorizes the same.
DOS_INLINE float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
DOS_INLINE uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Element types: how a stored value becomes an f32 and back. Rounding is to nearest
// even, NaNs become quiet NaNs of the same sign, as XLA's convert does.
struct F32 {
  using Storage = float;
  static DOS_INLINE float Load(float x) { return x; }
  static DOS_INLINE float Store(float x) { return x; }
};

struct BF16 {
  using Storage = uint16_t;
  static DOS_INLINE float Load(uint16_t x) { return BitsToFloat(uint32_t{x} << 16); }
  static DOS_INLINE uint16_t Store(float f) {
    const uint32_t u = FloatToBits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    return static_cast<uint16_t>(is_nan ? (((u >> 16) & 0x8000u) | 0x7fc0u) : rounded);
  }
};

struct F16 {
  using Storage = uint16_t;
  static DOS_INLINE uint16_t Store(float f) {
    const uint32_t u = FloatToBits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    // Magnitude bits; below 2^31, so signed compares (native in AVX2) are exact.
    const int32_t a = static_cast<int32_t>(u & 0x7fffffffu);
    // Normal halves: rebias the exponent and round the 13 dropped bits to even;
    // a carry out of the mantissa correctly rounds up to the next binade or to inf.
    const int32_t normal = (a - 0x37fff001 + ((a >> 13) & 1)) >> 13;
    // Subnormal halves: adding 0.5 aligns the 10 kept bits at the bottom of the f32
    // mantissa and lets the FPU round to even.
    const int32_t sub = static_cast<int32_t>(
        FloatToBits(BitsToFloat(static_cast<uint32_t>(a)) + 0.5f) - 0x3f000000u);
    int32_t h = a < 0x38800000 ? sub : normal;
    h = a >= 0x47800000 ? 0x7c00 : h;  // >= 65536 overflows to inf
    h = a > 0x7f800000 ? (0x7e00 | (a >> 13)) : h;  // NaN: quiet, top payload bits kept
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(h));
  }
};

// No low-precision copy wanted (its result has zero elements).
struct NoLowp {
  using Storage = uint16_t;
};

struct Pointers {
  float* master;
  void* mu;
  float* nu;
  const void* grad;
  void* lowp;
};

// The update of elements [begin, end) of one subgroup whose decay ends at `decay_end`.
// All pointers are distinct arrays; reads and writes of one array hit the same index.
template <class G, class M, class L, bool kNesterov, bool kDecay>
DOS_INLINE void UpdateRange(const Coeffs& c, float* __restrict master,
                            typename M::Storage* __restrict mu, float* __restrict nu,
                            const typename G::Storage* __restrict grad,
                            typename L::Storage* __restrict lowp, int64_t begin,
                            int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = G::Load(grad[i]) * c.gscale;
    const float p = master[i];
    const float m = __builtin_fmaf(c.omb1, g, c.b1 * M::Load(mu[i]));
    const float v = __builtin_fmaf(c.omb2, g * g, c.b2 * nu[i]);
    float m_hat;
    if constexpr (kNesterov) {
      m_hat = __builtin_fmaf(c.b1, m * c.inv_bc1_next, c.omb1 * (g * c.inv_bc1));
    } else {
      m_hat = m * c.inv_bc1;
    }
    const float v_hat = __builtin_fmaf(v, c.inv_bc2, c.eps_root);
    float u = m_hat / (__builtin_sqrtf(v_hat) + c.eps);
    if constexpr (kDecay) u = __builtin_fmaf(c.wd, p, u);
    const float p_new = __builtin_fmaf(c.neg_lr, u, p);
    master[i] = p_new;
    mu[i] = M::Store(m);
    nu[i] = v;
    if constexpr (!std::is_same_v<L, NoLowp>) lowp[i] = L::Store(p_new);
  }
}

template <class G, class M, class L, bool kNesterov>
DOS_INLINE void UpdateChunk(const Coeffs& c, const Pointers& ptr, int64_t begin,
                            int64_t end, int64_t decay_end) {
  auto* master = ptr.master;
  auto* mu = static_cast<typename M::Storage*>(ptr.mu);
  auto* nu = ptr.nu;
  auto* grad = static_cast<const typename G::Storage*>(ptr.grad);
  auto* lowp = static_cast<typename L::Storage*>(ptr.lowp);
  const int64_t mid = std::clamp(decay_end, begin, end);
  UpdateRange<G, M, L, kNesterov, true>(c, master, mu, nu, grad, lowp, begin, mid);
  UpdateRange<G, M, L, kNesterov, false>(c, master, mu, nu, grad, lowp, mid, end);
}

using ChunkFn = void (*)(const Coeffs&, const Pointers&, int64_t, int64_t, int64_t);

// One instantiation per instruction set: the same source, vectorized for each.
template <class G, class M, class L, bool N>
void ChunkBaseline(const Coeffs& c, const Pointers& p, int64_t b, int64_t e, int64_t d) {
  UpdateChunk<G, M, L, N>(c, p, b, e, d);
}

#if DOS_X86
template <class G, class M, class L, bool N>
__attribute__((target("avx2,fma,f16c"))) void ChunkAvx2(
    const Coeffs& c, const Pointers& p, int64_t b, int64_t e, int64_t d) {
  UpdateChunk<G, M, L, N>(c, p, b, e, d);
}

template <class G, class M, class L, bool N>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
void ChunkAvx512(const Coeffs& c, const Pointers& p, int64_t b, int64_t e, int64_t d) {
  UpdateChunk<G, M, L, N>(c, p, b, e, d);
}
#endif

// Instruction sets, as the Python side names them (host_adamw.HostIsa).
enum Isa : int64_t { kAuto = 0, kBaseline = 1, kAvx2 = 2, kAvx512 = 3 };

int64_t SupportedIsaMask() {
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

template <class G, class M, class L, bool N>
ChunkFn SelectIsa(int64_t isa) {
  switch (isa) {
#if DOS_X86
    case kAvx512: return &ChunkAvx512<G, M, L, N>;
    case kAvx2: return &ChunkAvx2<G, M, L, N>;
#endif
    default: return &ChunkBaseline<G, M, L, N>;
  }
}

template <class G, class M, class L>
ChunkFn SelectNesterov(bool nesterov, int64_t isa) {
  return nesterov ? SelectIsa<G, M, L, true>(isa) : SelectIsa<G, M, L, false>(isa);
}

template <class G, class M>
ChunkFn SelectLowp(ffi::DataType lowp, bool nesterov, int64_t isa) {
  switch (lowp) {
    case ffi::DataType::INVALID: return SelectNesterov<G, M, NoLowp>(nesterov, isa);
    case ffi::DataType::F32: return SelectNesterov<G, M, F32>(nesterov, isa);
    case ffi::DataType::BF16: return SelectNesterov<G, M, BF16>(nesterov, isa);
    case ffi::DataType::F16: return SelectNesterov<G, M, F16>(nesterov, isa);
    default: return nullptr;
  }
}

template <class G>
ChunkFn SelectMu(ffi::DataType mu, ffi::DataType lowp, bool nesterov, int64_t isa) {
  switch (mu) {
    case ffi::DataType::F32: return SelectLowp<G, F32>(lowp, nesterov, isa);
    case ffi::DataType::BF16: return SelectLowp<G, BF16>(lowp, nesterov, isa);
    default: return nullptr;
  }
}

ChunkFn SelectKernel(ffi::DataType grad, ffi::DataType mu, ffi::DataType lowp,
                     bool nesterov, int64_t isa) {
  switch (grad) {
    case ffi::DataType::F32: return SelectMu<F32>(mu, lowp, nesterov, isa);
    case ffi::DataType::BF16: return SelectMu<BF16>(mu, lowp, nesterov, isa);
    default: return nullptr;
  }
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

constexpr int64_t kAlign = 16;  // elements: one 64-byte line of f32
constexpr int64_t kMinPerThread = int64_t{1} << 15;
constexpr int64_t kMinChunk = int64_t{1} << 14;
constexpr int64_t kChunksPerThread = 16;

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
  if (isa == kAuto) {
    const int64_t mask = SupportedIsaMask();
    isa = (mask >> kAvx512) & 1 ? kAvx512 : (mask >> kAvx2) & 1 ? kAvx2 : kBaseline;
  } else if (!((SupportedIsaMask() >> isa) & 1)) {
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

  // Threads take chunks from a shared counter rather than one fixed slice each, so a
  // thread slowed by a busy core does not hold the others up at the join.
  const int64_t want = std::max<int64_t>(1, num_threads);
  const int64_t threads = std::clamp<int64_t>(pb.total / kMinPerThread, 1, want);
  const int64_t chunk =
      std::max(kMinChunk, (pb.total / (threads * kChunksPerThread) + kAlign - 1) / kAlign * kAlign);
  std::atomic<int64_t> next{0};
  auto work = [&pb, &next, chunk] {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < pb.total;) {
      RunRange(pb, begin, std::min(pb.total, begin + chunk));
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
  const int64_t chunk = std::max(kMinChunk, n / (threads * kChunksPerThread) / kAlign * kAlign);
  std::vector<double> seconds;
  for (int64_t r = 0; r < reps; ++r) {
    std::atomic<int64_t> next{0};
    auto work = [&] {
      for (int64_t b; (b = next.fetch_add(chunk)) < n;) pass(b, std::min(n, b + chunk));
    };
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int64_t t = 1; t < threads; ++t) workers.emplace_back(work);
    work();
    for (auto& w : workers) w.join();
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
static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DosJaxAdamWHost), nullptr, nullptr);
}

static PyObject* HandlerLowpIn(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DosJaxAdamWHostLowpIn), nullptr, nullptr);
}

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
