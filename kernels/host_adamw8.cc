// Native AdamW with block-wise 8-bit moments (kernels/adamw8_reference.py's format): an
// XLA FFI custom call for the CPU platform over rows of an fp32 master, uint8 codes and
// fp32 per-block scales of mu and nu, all updated in place.
//
// Per block of kBlock8 elements of a row, in three passes over L1: (1) decode mu and nu
// (map[code] * scale), the new moments, their block maxima; (2) the direction, the new
// master and its 16-bit cast; (3) the new codes, the nearest map entry of m / max. The
// new moments live only in a per-thread scratch of one block (2 KB); no state-sized
// fp32 copy of a moment exists.
//
// Arithmetic: every operation rounded to fp32 in adamw8_reference.adamw8_step's order
// (dtype=np.float32), no FMA (-ffp-contract=off), denormals flushed as XLA:CPU does. The
// masters and the scales are then the reference's bit for bit; a code may differ by one
// from the reference's (float64) nearest code where m / max lies within a few fp32 steps
// of a midpoint between two entries, since the kernel multiplies by the fp32 reciprocal
// of the max.
//
// Nearest code without a search: the Python side builds, per map and sign, a table
// `base` over buckets of |x| (its fp32 exponent and top 8 mantissa bits, 2^-24 <= |x| <=
// 1: 6145 buckets) giving the code of the bucket's lower edge, and a table `thr` over
// codes giving the one midpoint a bucket can contain (the map's entries are at least
// 0.7% apart, a bucket at most 0.39% wide); the code is base + (|x| > thr[base] ? step
// : 0), step +1 for x >= 0 and -1 below (host_adamw8.py, `quant_tables`).

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "adamw_loop.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dos_jax_host_adamw;  // NOLINT: the shared loop's internals

constexpr int64_t kBlock8 = 256;  // adamw8_reference.BLOCK_SIZE
constexpr int64_t kBuckets = 6145;  // |x| buckets, 2^-24 .. 1 (host_adamw8.py)
constexpr int64_t kBucketStride = 6160;  // per table, padded
constexpr uint32_t kBucketBase = 103u << 8;  // bits >> 15 of 2^-24

// The decoding maps and the encoding tables (host_adamw8.quant_tables).
struct Tables {
  const float* map[2];  // [signed, unsigned][256]
  const uint8_t* base[2];  // [map][sign][kBucketStride]
  const float* thr[2];  // [map][sign][256]
};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("dos_jax_adamw8_host: " + what);
}

// The code of x in one map (its base and thr tables, both signs).
DOS_INLINE uint8_t Encode(const uint8_t* __restrict base, const float* __restrict thr,
                          float x) {
  const uint32_t bits = FloatToBits(x);
  const uint32_t neg = bits >> 31;
  const uint32_t a = bits & 0x7fffffffu;
  int32_t k = static_cast<int32_t>(a >> 15) - static_cast<int32_t>(kBucketBase);
  k = std::min<int32_t>(std::max<int32_t>(k, 0), kBuckets - 1);
  const int32_t b = base[neg * kBucketStride + k];
  const int32_t step = BitsToFloat(a) > thr[neg * 256 + b] ? (neg ? -1 : 1) : 0;
  return static_cast<uint8_t>(b + step);
}

// Pass 1: decode, new moments into m, v; returns their block maxima (|m|, v).
template <class G>
DOS_INLINE void MomentsPass8(const Coeffs& c, const float* __restrict map_s,
                             const float* __restrict map_u, const uint8_t* __restrict cm,
                             const uint8_t* __restrict cv, float sm, float sv,
                             const typename G::Storage* __restrict grad,
                             float* __restrict m, float* __restrict v, float* __restrict gs,
                             int64_t n, float& max_m, float& max_v) {
  float am = 0, av = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float g = G::Load(grad[i]) * c.gscale;
    const float m0 = map_s[cm[i]] * sm;
    const float v0 = map_u[cv[i]] * sv;
    const float mi = c.omb1 * g + c.b1 * m0;
    const float vi = c.omb2 * (g * g) + c.b2 * v0;
    m[i] = mi;
    v[i] = vi;
    gs[i] = g;
    am = std::max(am, std::fabs(mi));
    av = std::max(av, std::fabs(vi));
  }
  max_m = am, max_v = av;
}

// Pass 2: the direction from m, v and the new master (and its cast to L).
template <class L, bool kNesterov, bool kDecay>
DOS_INLINE void ApplyPass8(const Coeffs& c, const float* __restrict m,
                           const float* __restrict v, const float* __restrict gs,
                           float* __restrict master, typename L::Storage* __restrict out,
                           int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float m_hat;
    if constexpr (kNesterov) {
      m_hat = c.b1 * (m[i] * c.inv_bc1_next) + c.omb1 * (gs[i] * c.inv_bc1);
    } else {
      m_hat = m[i] * c.inv_bc1;
    }
    float u = m_hat / (std::sqrt(v[i] * c.inv_bc2 + c.eps_root) + c.eps);
    const float p = master[i];
    if constexpr (kDecay) u = u + c.wd * p;
    const float np = p + c.neg_lr * u;
    master[i] = np;
    if constexpr (!std::is_same_v<L, NoLowp>) out[i] = L::Store(np);
  }
}

// Pass 3: the codes of x * inv in one map.
DOS_INLINE void EncodePass(const uint8_t* __restrict base, const float* __restrict thr,
                           const float* __restrict x, float inv, uint8_t* __restrict codes,
                           int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = Encode(base, thr, x[i] * inv);
}

struct Row8 {
  float* master;
  uint8_t* cm;
  float* sm;
  uint8_t* cv;
  float* sv;
  const void* grad;
  void* out;
};

using Block8Fn = void (*)(const Coeffs&, const Tables&, const Row8&, int64_t, int64_t,
                          int64_t, bool);

// Blocks [b0, b1) of one row of `size` elements (the last block may be short).
template <class G, class L>
struct Blocks8 {
  using Fn = Block8Fn;
  template <bool kNesterov>
  static DOS_INLINE void Run(const Coeffs& c, const Tables& t, const Row8& r, int64_t size,
                             int64_t b0, int64_t b1, bool decay) {
    alignas(64) float m[kBlock8], v[kBlock8], gs[kBlock8];
    auto* grad = static_cast<const typename G::Storage*>(r.grad);
    auto* out = static_cast<typename L::Storage*>(r.out);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t at = b * kBlock8;
      const int64_t n = std::min(kBlock8, size - at);
      float max_m, max_v;
      MomentsPass8<G>(c, t.map[0], t.map[1], r.cm + at, r.cv + at, r.sm[b], r.sv[b],
                      grad + at, m, v, gs, n, max_m, max_v);
      if (decay) {
        ApplyPass8<L, kNesterov, true>(c, m, v, gs, r.master + at, out + at, n);
      } else {
        ApplyPass8<L, kNesterov, false>(c, m, v, gs, r.master + at, out + at, n);
      }
      r.sm[b] = max_m;
      r.sv[b] = max_v;
      EncodePass(t.base[0], t.thr[0], m, max_m > 0 ? 1.0f / max_m : 0.0f, r.cm + at, n);
      EncodePass(t.base[1], t.thr[1], v, max_v > 0 ? 1.0f / max_v : 0.0f, r.cv + at, n);
    }
  }
};

template <class G>
Block8Fn SelectOut8(ffi::DataType out, bool nesterov, int64_t isa) {
  switch (out) {
    case ffi::DataType::INVALID: return SelectIsa<Blocks8<G, NoLowp>>(nesterov, isa);
    case ffi::DataType::F32: return SelectIsa<Blocks8<G, F32>>(nesterov, isa);
    case ffi::DataType::BF16: return SelectIsa<Blocks8<G, BF16>>(nesterov, isa);
    case ffi::DataType::F16: return SelectIsa<Blocks8<G, F16>>(nesterov, isa);
    default: return nullptr;
  }
}

Block8Fn Select8(ffi::DataType grad, ffi::DataType out, bool nesterov, int64_t isa) {
  switch (grad) {
    case ffi::DataType::F32: return SelectOut8<F32>(out, nesterov, isa);
    case ffi::DataType::BF16: return SelectOut8<BF16>(out, nesterov, isa);
    default: return nullptr;
  }
}

// Runs fn(begin, end) over blocks [0, total) in chunks from a shared counter.
template <class Fn>
void ParallelBlocks(int64_t total, int64_t threads, const Fn& fn) {
  const int64_t chunk = std::max<int64_t>(64, total / (threads * kChunksPerThread));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    ScopedFlushDenormals flush;
    for (int64_t begin; (begin = next.fetch_add(chunk)) < total;) {
      fn(begin, std::min(total, begin + chunk));
    }
  };
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (auto& w : workers) w.join();
}

// Rows (R, S) of master, codes and grads; scales (R, ceil(S / kBlock8)); rows below
// `decayed_rows` get weight decay. Everything but grads, coefficients and tables is
// updated in place (aliased inputs and results).
ffi::Error Adamw8Impl(ffi::Buffer<ffi::F32> master, ffi::Buffer<ffi::U8> mu_codes,
                      ffi::Buffer<ffi::F32> mu_scales, ffi::Buffer<ffi::U8> nu_codes,
                      ffi::Buffer<ffi::F32> nu_scales, ffi::AnyBuffer grad,
                      ffi::Buffer<ffi::F32> coeffs, ffi::Buffer<ffi::F32> maps,
                      ffi::Buffer<ffi::U8> bases, ffi::Buffer<ffi::F32> thresholds,
                      ffi::ResultBuffer<ffi::F32> master_out,
                      ffi::ResultBuffer<ffi::U8> mu_codes_out,
                      ffi::ResultBuffer<ffi::F32> mu_scales_out,
                      ffi::ResultBuffer<ffi::U8> nu_codes_out,
                      ffi::ResultBuffer<ffi::F32> nu_scales_out,
                      ffi::Result<ffi::AnyBuffer> out, int64_t decayed_rows,
                      int64_t num_threads, bool nesterov, int64_t isa) {
  const auto dims = master.dimensions();
  if (dims.size() != 2) return Invalid("master must be (R, S)");
  const int64_t R = dims[0], S = dims[1], NB = (S + kBlock8 - 1) / kBlock8;
  const auto n = static_cast<size_t>(R * S);
  if (mu_codes.element_count() != n || nu_codes.element_count() != n ||
      grad.element_count() != n) {
    return Invalid("codes and grads must be (R, S) like master");
  }
  if (mu_scales.element_count() != static_cast<size_t>(R * NB) ||
      nu_scales.element_count() != static_cast<size_t>(R * NB)) {
    return Invalid("scales must be (R, ceil(S / 256))");
  }
  const bool has_out = out->element_count() != 0;
  if (has_out && out->element_count() != n) return Invalid("out must be (R, S) or empty");
  if (coeffs.element_count() != kNumSlots) return Invalid("bad coefficient vector");
  if (maps.element_count() != 2 * 256 || bases.element_count() != 4 * kBucketStride ||
      thresholds.element_count() != 4 * 256) {
    return Invalid("bad quantization tables");
  }
  if (master_out->typed_data() != master.typed_data() ||
      mu_codes_out->typed_data() != mu_codes.typed_data() ||
      mu_scales_out->typed_data() != mu_scales.typed_data() ||
      nu_codes_out->typed_data() != nu_codes.typed_data() ||
      nu_scales_out->typed_data() != nu_scales.typed_data()) {
    return Invalid("the state must be aliased to the results");
  }
  if (!ResolveIsa(isa)) return Invalid("this CPU lacks the ISA asked for");
  Block8Fn fn = Select8(grad.element_type(), has_out ? out->element_type()
                                                     : ffi::DataType::INVALID, nesterov, isa);
  if (fn == nullptr) return Invalid("unsupported dtypes");
  if (has_out) AdviseHugePages(out->untyped_data(), out->size_bytes());
  const Coeffs c(coeffs.typed_data());
  Tables t;
  for (int k = 0; k < 2; ++k) {
    t.map[k] = maps.typed_data() + k * 256;
    t.base[k] = bases.typed_data() + k * 2 * kBucketStride;
    t.thr[k] = thresholds.typed_data() + k * 2 * 256;
  }
  const size_t grad_bytes = ffi::ByteWidth(grad.element_type());
  const size_t out_bytes = has_out ? ffi::ByteWidth(out->element_type()) : 0;
  auto* grad_base = static_cast<const char*>(grad.untyped_data());
  auto* out_base = static_cast<char*>(out->untyped_data());
  const int64_t total = R * NB;
  ParallelBlocks(total, ThreadsFor(R * S, num_threads), [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t row = begin / NB, b0 = begin - row * NB;
      const int64_t b1 = std::min(NB, end - row * NB);
      const int64_t at = row * S;
      Row8 r{master.typed_data() + at, mu_codes.typed_data() + at,
             mu_scales.typed_data() + row * NB, nu_codes.typed_data() + at,
             nu_scales.typed_data() + row * NB, grad_base + at * grad_bytes,
             has_out ? out_base + at * out_bytes : nullptr};
      fn(c, t, r, S, b0, b1, row < decayed_rows);
      begin = row * NB + b1;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DosJaxAdamW8Host, Adamw8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // master (R, S)
                                  .Arg<ffi::Buffer<ffi::U8>>()  // mu codes (R, S)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mu scales (R, NB)
                                  .Arg<ffi::Buffer<ffi::U8>>()  // nu codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // nu scales
                                  .Arg<ffi::AnyBuffer>()  // grad (R, S) f32 or bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefficients
                                  .Arg<ffi::Buffer<ffi::F32>>()  // maps (2, 256)
                                  .Arg<ffi::Buffer<ffi::U8>>()  // bases (2, 2, stride)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // thresholds (2, 2, 256)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()  // out (R, S) or empty
                                  .Attr<int64_t>("decayed_rows")
                                  .Attr<int64_t>("num_threads")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("isa"));

DOS_HANDLER_CAPSULE(Handler, DosJaxAdamW8Host)

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the 8-bit-moment host AdamW."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_host_adamw8",
                              "Native host AdamW with block-wise 8-bit moments (XLA FFI).",
                              -1, kMethods};

PyMODINIT_FUNC PyInit__host_adamw8() { return PyModule_Create(&kModule); }
