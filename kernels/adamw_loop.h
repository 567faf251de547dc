// The AdamW loop of the native host kernel: element types, the per-element update in
// optax's op order, and its instantiations per dtype (per instruction set through
// adamw_common.h).
//
// Why results match jax.jit(optax.adamw) on one flat f32 array bit for bit (tested):
// the kernel is compiled with -ffp-contract=off and every fused multiply-add below is
// explicit, placed where XLA:CPU's LLVM contracts one; divisions by a per-step scalar
// are multiplications by its f32 reciprocal, which is what XLA's algebraic simplifier
// makes of them there; and denormals are flushed to zero as XLA:CPU does while it
// runs. (XLA rewrites differently compiled programs of the same math differently, e.g.
// optax over several leaves; those agree with this kernel to an ulp, not to the bit.)
// This loop was first the flat host kernel's (host_adamw.cc, since removed: only
// benchmarks used it); the row-wise kernel's notes still call it that.
//
// Included by host_adamw_rows.cc and host_adamw_disk.cc (through adamw_rows.h); internal
// to those translation units.

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

// The bias-corrected first moment of an element with gradient g and new moment m
// (Nesterov: also with the next step's correction).
template <bool kNesterov>
DOS_INLINE float MHat(const Coeffs& c, float g, float m) {
  if constexpr (kNesterov) {
    return __builtin_fmaf(c.b1, m * c.inv_bc1_next, c.omb1 * (g * c.inv_bc1));
  } else {
    return m * c.inv_bc1;
  }
}

// The step direction from m_hat and the new second moment v of an element p:
// preconditioned, plus weight decay when kDecay.
template <bool kDecay>
DOS_INLINE float Direction(const Coeffs& c, float m_hat, float v, float p) {
  const float v_hat = __builtin_fmaf(v, c.inv_bc2, c.eps_root);
  float u = m_hat / (__builtin_sqrtf(v_hat) + c.eps);
  if constexpr (kDecay) u = __builtin_fmaf(c.wd, p, u);
  return u;
}

// Both loops run in blocks of kBlock elements, each block in passes: the moments, then
// the direction and the new params, then the 16-bit cast. The same operations on every
// element as one fused loop (so the same bits), in less time: on cores whose divider
// is slow (AMD Zen 1: 256-bit vsqrtps and vdivps split in two, one divider per core)
// the fused loop's sqrt -> div chain holds the out-of-order window, with the moments'
// and the cast's work queued behind it (a third of the profile's samples sat on those
// two instructions); in a short loop of its own, one vector's chain overlaps the next.
// Standalone copy of the bf16 row loop on a Zen 1 EPYC, one thread, CPU time: 2.64 ->
// 2.23 ns per element over 64M elements, 2.50 -> 1.98 in L1. 256 elements: 1 KB per
// f32 array, so the later passes read from L1 what the earlier ones wrote (512 and
// 2048 were slower over 64M). An approximate square root and reciprocal (vrsqrtps,
// vrcpps, Newton steps) in place of vsqrtps and vdivps was slower still on that core:
// its FMA pipes are the other bound (experiments/RESULTS.md, 2026-11-24).
constexpr int64_t kBlock = 256;

// Second pass over one block, with a master: the new master p + (-lr) * u from m_hat
// (kScaleMu: m_hat = m_hat_or_m * inv_bc1, the f32 first moment read back) and v.
// Restrict-qualified parameters: GCC vectorizes only then.
template <bool kDecay, bool kScaleMu>
DOS_INLINE void ApplyPass(const Coeffs& c, const float* __restrict m_hat_or_m,
                          const float* __restrict nu, float* __restrict master, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float m_hat = kScaleMu ? m_hat_or_m[i] * c.inv_bc1 : m_hat_or_m[i];
    const float p = master[i];
    master[i] = __builtin_fmaf(c.neg_lr, Direction<kDecay>(c, m_hat, nu[i], p), p);
  }
}

// The same without a master (f32 params): the update -lr * u of params `param`.
template <bool kDecay, bool kScaleMu>
DOS_INLINE void UpdatePass(const Coeffs& c, const float* __restrict m_hat_or_m,
                           const float* __restrict nu, const float* __restrict param,
                           float* __restrict update, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float m_hat = kScaleMu ? m_hat_or_m[i] * c.inv_bc1 : m_hat_or_m[i];
    update[i] = c.neg_lr * Direction<kDecay>(c, m_hat, nu[i], param[i]);
  }
}

// Third pass: the cast of the new params to L.
template <class L>
DOS_INLINE void CastPass(const float* __restrict p, typename L::Storage* __restrict out,
                         int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = L::Store(p[i]);
}

// First pass of the flat loop over one block: the new moments, stored, and m_hat
// (unless the second pass can scale the f32 moment it reads back).
template <class G, class M, bool kNesterov, bool kKeepMHat>
DOS_INLINE void MomentsPass(const Coeffs& c, typename M::Storage* __restrict mu,
                            float* __restrict nu, const typename G::Storage* __restrict grad,
                            float* __restrict m_hat, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = G::Load(grad[i]) * c.gscale;
    const float m = __builtin_fmaf(c.omb1, g, c.b1 * M::Load(mu[i]));
    nu[i] = __builtin_fmaf(c.omb2, g * g, c.b2 * nu[i]);
    mu[i] = M::Store(m);
    if constexpr (kKeepMHat) m_hat[i] = MHat<kNesterov>(c, g, m);
  }
}

// The update of elements [begin, end) of one subgroup whose decay ends at `decay_end`.
// All pointers are distinct arrays; reads and writes of one array hit the same index.
template <class G, class M, class L, bool kNesterov, bool kDecay>
DOS_INLINE void UpdateRange(const Coeffs& c, float* master, typename M::Storage* mu,
                            float* nu, const typename G::Storage* grad,
                            typename L::Storage* lowp, int64_t begin, int64_t end) {
  // m_hat is the stored f32 moment times 1 / bc1 except with a bf16 moment (rounded
  // when stored) or Nesterov (which also needs g): then the first pass keeps it.
  constexpr bool kKeepMHat = kNesterov || !std::is_same_v<M, F32>;
  alignas(64) float m_hat[kKeepMHat ? kBlock : 1];
  for (int64_t at = begin; at < end; at += kBlock) {
    const int64_t n = std::min(kBlock, end - at);
    MomentsPass<G, M, kNesterov, kKeepMHat>(c, mu + at, nu + at, grad + at, m_hat, n);
    if constexpr (kKeepMHat) {
      ApplyPass<kDecay, false>(c, m_hat, nu + at, master + at, n);
    } else {
      ApplyPass<kDecay, true>(c, mu + at, nu + at, master + at, n);
    }
    if constexpr (!std::is_same_v<L, NoLowp>) CastPass<L>(master + at, lowp + at, n);
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
