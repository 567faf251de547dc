// The AVX-512 (with VBMI) block kernel of the 8-bit-moment host AdamW: the codes decoded
// by in-register byte lookups, the moments and the encoding in 16-lane vectors, the same
// operations as adamw8_loop.h's scalar kernel lane for lane.
//
// Included by host_adamw8.cc; internal to it.

#ifndef DOS_JAX_KERNELS_ADAMW8_AVX512_H_
#define DOS_JAX_KERNELS_ADAMW8_AVX512_H_

#include "adamw8_loop.h"

#if DOS_X86
#include <immintrin.h>

namespace dos_jax_host_adamw8 {

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

}  // namespace dos_jax_host_adamw8

#endif  // DOS_X86
#endif  // DOS_JAX_KERNELS_ADAMW8_AVX512_H_
