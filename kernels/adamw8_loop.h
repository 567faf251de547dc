// The element loop of the 8-bit-moment host AdamW (host_adamw8.cc): the format's
// constants, the encoding, the three passes over a block and the scalar block kernel,
// compiled per instruction set through adamw_common.h's SelectIsa.
//
// Included by host_adamw8.cc (and adamw8_avx512.h); internal to it.

#ifndef DOS_JAX_KERNELS_ADAMW8_LOOP_H_
#define DOS_JAX_KERNELS_ADAMW8_LOOP_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "adamw_loop.h"

namespace dos_jax_host_adamw8 {

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

}  // namespace dos_jax_host_adamw8

#endif  // DOS_JAX_KERNELS_ADAMW8_LOOP_H_
