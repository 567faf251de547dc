// The AdamW loop of the native host kernel: element types, the per-element update in
// optax's op order, and its instantiations per dtype (per instruction set through
// adamw_common.h).
//
// Included by host_adamw.cc and host_adamw_rows.cc; internal to those translation units.

#ifndef DOS_JAX_KERNELS_ADAMW_LOOP_H_
#define DOS_JAX_KERNELS_ADAMW_LOOP_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adamw_common.h"
#include "xla/ffi/api/ffi.h"

namespace dos_jax_host_adamw {

namespace ffi = xla::ffi;

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
    // NaN test as a float compare (one vcmpps), not on the bits (and, sub, compare):
    // the same answer, and 9% less time for the whole bf16-out loop on AVX2.
    return static_cast<uint16_t>(f != f ? (((u >> 16) & 0x8000u) | 0x7fc0u) : rounded);
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

// The step direction from the new moments m and v of an element p with gradient g:
// bias-corrected (Nesterov: also with the next step's correction), preconditioned,
// plus weight decay when kDecay. Shared by both host kernels' loops.
template <bool kNesterov, bool kDecay>
DOS_INLINE float Direction(const Coeffs& c, float g, float p, float m, float v) {
  float m_hat;
  if constexpr (kNesterov) {
    m_hat = __builtin_fmaf(c.b1, m * c.inv_bc1_next, c.omb1 * (g * c.inv_bc1));
  } else {
    m_hat = m * c.inv_bc1;
  }
  const float v_hat = __builtin_fmaf(v, c.inv_bc2, c.eps_root);
  float u = m_hat / (__builtin_sqrtf(v_hat) + c.eps);
  if constexpr (kDecay) u = __builtin_fmaf(c.wd, p, u);
  return u;
}

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
    const float u = Direction<kNesterov, kDecay>(c, g, p, m, v);
    const float p_new = __builtin_fmaf(c.neg_lr, u, p);
    master[i] = p_new;
    mu[i] = M::Store(m);
    nu[i] = v;
    if constexpr (!std::is_same_v<L, NoLowp>) lowp[i] = L::Store(p_new);
  }
}

using ChunkFn = void (*)(const Coeffs&, const Pointers&, int64_t, int64_t, int64_t);

// Elements [begin, end) of the flat state, decayed below `decay_end`: a kernel for
// SelectIsa (adamw_common.h).
template <class G, class M, class L>
struct Chunk {
  using Fn = ChunkFn;
  template <bool kNesterov>
  static DOS_INLINE void Run(const Coeffs& c, const Pointers& ptr, int64_t begin,
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
};

template <class G, class M>
ChunkFn SelectLowp(ffi::DataType lowp, bool nesterov, int64_t isa) {
  switch (lowp) {
    case ffi::DataType::INVALID: return SelectIsa<Chunk<G, M, NoLowp>>(nesterov, isa);
    case ffi::DataType::F32: return SelectIsa<Chunk<G, M, F32>>(nesterov, isa);
    case ffi::DataType::BF16: return SelectIsa<Chunk<G, M, BF16>>(nesterov, isa);
    case ffi::DataType::F16: return SelectIsa<Chunk<G, M, F16>>(nesterov, isa);
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

inline ChunkFn SelectKernel(ffi::DataType grad, ffi::DataType mu, ffi::DataType lowp,
                            bool nesterov, int64_t isa) {
  switch (grad) {
    case ffi::DataType::F32: return SelectMu<F32>(mu, lowp, nesterov, isa);
    case ffi::DataType::BF16: return SelectMu<BF16>(mu, lowp, nesterov, isa);
    default: return nullptr;
  }
}

}  // namespace dos_jax_host_adamw

#endif  // DOS_JAX_KERNELS_ADAMW_LOOP_H_
