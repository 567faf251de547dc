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
// Nearest code without a search: the Python side builds, per map and sign, a table over
// buckets of |x| (its fp32 exponent and top 8 mantissa bits, 2^-24 <= |x| <= 1: 6145
// buckets) whose entry holds the code of the bucket's lower edge and the one midpoint
// between codes the bucket can contain (the map's entries are at least 0.7% apart, a
// bucket at most 0.39% wide), as fp32 bits within the bucket; one gather and one integer
// compare give the code (host_adamw8.py, `_encoding_table`).

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

#if DOS_X86
#include <immintrin.h>
#endif

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
  const uint32_t* enc[2];  // [map][sign][kBucketStride]: base | (low + 1) << 8
  const uint8_t* planes[2];  // [map][byte p][256]: byte p of each entry (AVX-512 VBMI)
};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("dos_jax_adamw8_host: " + what);
}

// The code of x in one map (its encoding table, both signs).
DOS_INLINE uint8_t Encode(const uint32_t* __restrict enc, float x) {
  const uint32_t bits = FloatToBits(x);
  const uint32_t neg = bits >> 31;
  const int32_t a = static_cast<int32_t>(bits & 0x7fffffffu);
  int32_t k = (a >> 15) - static_cast<int32_t>(kBucketBase);
  k = std::min<int32_t>(std::max<int32_t>(k, 0), kBuckets - 1);
  const int32_t e = static_cast<int32_t>(enc[neg * kBucketStride + k]);
  const int32_t step = (a & 0x7fff) > (e >> 8) - 1 ? (neg ? -1 : 1) : 0;
  return static_cast<uint8_t>((e & 0xff) + step);
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
DOS_INLINE void EncodePass(const uint32_t* __restrict enc, const float* __restrict x,
                           float inv, uint8_t* __restrict codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = Encode(enc, x[i] * inv);
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
      EncodePass(t.enc[0], m, max_m > 0 ? 1.0f / max_m : 0.0f, r.cm + at, n);
      EncodePass(t.enc[1], v, max_v > 0 ? 1.0f / max_v : 0.0f, r.cv + at, n);
    }
  }
};

#if DOS_X86
// The same blocks with AVX-512 intrinsics (and VBMI's byte permutes) for passes 1 and 3:
// the codes are decoded by in-register lookups (no gathers) into a block scratch, and
// encoded with one gather each; pass 2 is the scalar loop, vectorized by the compiler
// inside this target. Tails of fewer than 16 elements take scalar code. Every lane
// computes what the scalar code computes, operation for operation.
#define DOS_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")))
#define DOS_AVX512_VBMI DOS_AVX512

template <class G>
DOS_AVX512 DOS_INLINE __m512 LoadGrad16(const typename G::Storage* p) {
  if constexpr (std::is_same_v<G, F32>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Position 16 l + 4 r + k of a permuted group of 64 codes holds code 16 r + 4 l + k.
alignas(64) constexpr uint8_t kDecodeOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

// Decodes a block's n codes of one map (its 4 byte planes, 16 registers) into
// map[code] * scale, 64 at a time: vpermi2b looks each byte of the entries up, the
// unpacks put the bytes of an entry together. The codes are first permuted so that the
// unpacks (within 128-bit lanes) leave the floats in element order.
DOS_AVX512_VBMI DOS_INLINE void Decode64s(const uint8_t* planes, const uint8_t* codes,
                                          float scale, float* out, int64_t n) {
  __m512i t[4][4];
  for (int p = 0; p < 4; ++p) {
    for (int q = 0; q < 4; ++q) {
      t[p][q] = _mm512_loadu_si512(planes + p * 256 + q * 64);
    }
  }
  const __m512i perm = _mm512_load_si512(kDecodeOrder);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 64) {
    const __mmask64 live = n - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - i)) - 1;
    const __m512i idx = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(live, codes + i));
    const __mmask64 top = _mm512_movepi8_mask(idx);
    __m512i b[4];
    for (int p = 0; p < 4; ++p) {
      b[p] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[p][0], idx, t[p][1]),
                                    _mm512_permutex2var_epi8(t[p][2], idx, t[p][3]));
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int r = 0; r < 4; ++r) {
      _mm512_store_ps(out + i + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(f[r]), sv));
    }
  }
}

// Pass 1 from the decoded moments m0, v0 (the block scratch, kBlock8 long): new moments
// into m, v (and the scaled gradients into gs), their block maxima.
template <class G>
DOS_AVX512 DOS_INLINE void MomentsPass16(const Coeffs& c, const float* m0, const float* v0,
                                         const typename G::Storage* grad, float* m, float* v,
                                         float* gs, int64_t n, float& max_m, float& max_v) {
  const __m512 gscale = _mm512_set1_ps(c.gscale), omb1 = _mm512_set1_ps(c.omb1),
               b1 = _mm512_set1_ps(c.b1), omb2 = _mm512_set1_ps(c.omb2),
               b2 = _mm512_set1_ps(c.b2);
  __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps();
  const int64_t full = n & ~int64_t{15};
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 g = _mm512_mul_ps(LoadGrad16<G>(grad + i), gscale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(omb1, g), _mm512_mul_ps(b1, _mm512_load_ps(m0 + i)));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(omb2, _mm512_mul_ps(g, g)),
                                    _mm512_mul_ps(b2, _mm512_load_ps(v0 + i)));
    _mm512_store_ps(m + i, mi);
    _mm512_store_ps(v + i, vi);
    _mm512_store_ps(gs + i, g);
    // max(x, acc) returns acc when x is NaN, as std::max(acc, x) does.
    am = _mm512_max_ps(_mm512_abs_ps(mi), am);
    av = _mm512_max_ps(_mm512_abs_ps(vi), av);
  }
  float tail_m = 0, tail_v = 0;
  for (int64_t i = full; i < n; ++i) {
    const float g = G::Load(grad[i]) * c.gscale;
    m[i] = c.omb1 * g + c.b1 * m0[i];
    v[i] = c.omb2 * (g * g) + c.b2 * v0[i];
    gs[i] = g;
    tail_m = std::max(tail_m, std::fabs(m[i]));
    tail_v = std::max(tail_v, std::fabs(v[i]));
  }
  max_m = std::max(_mm512_reduce_max_ps(am), tail_m);
  max_v = std::max(_mm512_reduce_max_ps(av), tail_v);
}

DOS_AVX512 DOS_INLINE void EncodePass16(const uint32_t* enc, const float* x, float inv,
                                        uint8_t* codes, int64_t n) {
  const __m512 invv = _mm512_set1_ps(inv);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), lo = _mm512_setzero_si512(),
                hi = _mm512_set1_epi32(kBuckets - 1),
                bucket0 = _mm512_set1_epi32(static_cast<int32_t>(kBucketBase)),
                stride = _mm512_set1_epi32(kBucketStride), low_bits = _mm512_set1_epi32(0x7fff),
                byte = _mm512_set1_epi32(0xff), one = _mm512_set1_epi32(1);
  const int64_t full = n & ~int64_t{15};
  for (int64_t i = 0; i < full; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x + i), invv));
    const __m512i neg = _mm512_srai_epi32(bits, 31);  // -1 below zero, else 0
    const __m512i a = _mm512_and_si512(bits, abs_mask);
    __m512i k = _mm512_sub_epi32(_mm512_srli_epi32(a, 15), bucket0);
    k = _mm512_min_epi32(_mm512_max_epi32(k, lo), hi);
    k = _mm512_add_epi32(k, _mm512_and_si512(neg, stride));
    const __m512i e = _mm512_i32gather_epi32(k, enc, 4);
    const __m512i b = _mm512_and_si512(e, byte);
    const __m512i low = _mm512_sub_epi32(_mm512_srli_epi32(e, 8), one);
    const __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_and_si512(a, low_bits), low);
    const __m512i code = _mm512_mask_add_epi32(b, up, b, _mm512_or_si512(neg, one));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
  EncodePass(enc, x + full, inv, codes + full, n - full);
}

template <class G, class L, bool kNesterov>
DOS_AVX512 void Blocks8Avx512(const Coeffs& c, const Tables& t, const Row8& r, int64_t size,
                              int64_t b0, int64_t b1, bool decay) {
  alignas(64) float m[kBlock8], v[kBlock8], gs[kBlock8], m0[kBlock8], v0[kBlock8];
  auto* grad = static_cast<const typename G::Storage*>(r.grad);
  auto* out = static_cast<typename L::Storage*>(r.out);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = b * kBlock8;
    const int64_t n = std::min(kBlock8, size - at);
    float max_m, max_v;
    Decode64s(t.planes[0], r.cm + at, r.sm[b], m0, n);
    Decode64s(t.planes[1], r.cv + at, r.sv[b], v0, n);
    MomentsPass16<G>(c, m0, v0, grad + at, m, v, gs, n, max_m, max_v);
    if (decay) {
      ApplyPass8<L, kNesterov, true>(c, m, v, gs, r.master + at, out + at, n);
    } else {
      ApplyPass8<L, kNesterov, false>(c, m, v, gs, r.master + at, out + at, n);
    }
    r.sm[b] = max_m;
    r.sv[b] = max_v;
    EncodePass16(t.enc[0], m, max_m > 0 ? 1.0f / max_m : 0.0f, r.cm + at, n);
    EncodePass16(t.enc[1], v, max_v > 0 ? 1.0f / max_v : 0.0f, r.cv + at, n);
  }
}
#endif

inline bool HasVbmi() {
#if DOS_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

// The AVX-512 blocks for G, L.
template <class G, class L>
Block8Fn Avx512For(bool nesterov) {
#if DOS_X86
  return nesterov ? &Blocks8Avx512<G, L, true> : &Blocks8Avx512<G, L, false>;
#else
  return nullptr;
#endif
}

template <class G>
Block8Fn SelectOut8(ffi::DataType out, bool nesterov, int64_t isa) {
  if (isa == kAvx512 && HasVbmi()) {
    switch (out) {
      case ffi::DataType::INVALID: return Avx512For<G, NoLowp>(nesterov);
      case ffi::DataType::F32: return Avx512For<G, F32>(nesterov);
      case ffi::DataType::BF16: return Avx512For<G, BF16>(nesterov);
      case ffi::DataType::F16: return Avx512For<G, F16>(nesterov);
      default: return nullptr;
    }
  }
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
                      ffi::Buffer<ffi::U32> tables,
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
  if (maps.element_count() != 2 * 256 || tables.element_count() != 4 * kBucketStride) {
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
  uint8_t planes[2][4][256];
  for (int k = 0; k < 2; ++k) {
    t.map[k] = maps.typed_data() + k * 256;
    t.enc[k] = tables.typed_data() + k * 2 * kBucketStride;
    for (int p = 0; p < 4; ++p) {
      for (int e = 0; e < 256; ++e) {
        planes[k][p][e] = static_cast<uint8_t>(FloatToBits(t.map[k][e]) >> (8 * p));
      }
    }
    t.planes[k] = &planes[k][0][0];
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
                                  .Arg<ffi::Buffer<ffi::U32>>()  // encoding (2, 2, stride)
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
