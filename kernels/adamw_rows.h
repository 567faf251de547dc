// The loop over one subgroup's rows of the fp32 state (master, mu, nu, each S elements):
// the row kernel of the native host AdamW, picked per gradient dtype, out dtype, master
// or not, Nesterov and instruction set (`SelectRows`). Shared by the kernels that keep
// the state in memory (host_adamw_rows.cc) and on disk (host_adamw_disk.cc), so that
// both compute the same bits.
//
// Included by those translation units; internal to them.

#ifndef DOS_JAX_KERNELS_ADAMW_ROWS_H_
#define DOS_JAX_KERNELS_ADAMW_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "adamw_loop.h"
#include "xla/ffi/api/ffi.h"

namespace dos_jax_host_adamw {

// Where one subgroup's rows are: state slots and the row of grads, params and out.
struct RowPointers {
  float* master;  // nullptr without a master: the param is read from `param`
  float* mu;
  float* nu;
  const void* grad;
  const float* param;
  void* out;
};

// First pass over a block of a row: the new moments, stored in place, and (Nesterov)
// m_hat. The moments contract a different product into the FMA for 16-bit gradients:
// when the gradient is converted from bf16 inside the program, XLA:CPU fuses b1 * mu
// (not (1 - b1) * g) into the FMA, so jit(optax.adamw) on bf16 gradients, and the XLA
// row loop of dos_jax, round that way. With f32 gradients this is adamw_loop.h's order.
template <class G, bool kNesterov>
DOS_INLINE void RowMomentsPass(const Coeffs& c, float* __restrict mu, float* __restrict nu,
                               const typename G::Storage* __restrict grad,
                               float* __restrict m_hat, int64_t n) {
  constexpr bool kWideGrad = std::is_same_v<G, F32>;
  for (int64_t i = 0; i < n; ++i) {
    const float g = G::Load(grad[i]) * c.gscale;
    const float m = kWideGrad ? __builtin_fmaf(c.omb1, g, c.b1 * mu[i])
                              : __builtin_fmaf(c.b1, mu[i], c.omb1 * g);
    nu[i] = kWideGrad ? __builtin_fmaf(c.omb2, g * g, c.b2 * nu[i])
                      : __builtin_fmaf(c.b2, nu[i], c.omb2 * (g * g));
    mu[i] = m;
    if constexpr (kNesterov) m_hat[i] = MHat<kNesterov>(c, g, m);
  }
}

// Elements [begin, end) of one subgroup row, in blocks of passes (adamw_loop.h's
// kBlock: the same operations as one fused loop, faster where the divider is slow).
// With a master, the param is the master and the new master (and its cast to L) is
// written; without one (fp32 params) the param comes from the param rows and the
// update -lr * u is the output. The m_hat of the second pass is the f32 moment read
// back times 1 / bc1, except under Nesterov (which also needs g).
template <class G, class L, bool kMaster, bool kNesterov, bool kDecay>
DOS_INLINE void RowRangeFixed(const Coeffs& c, float* master, float* mu, float* nu,
                              const typename G::Storage* grad, const float* param,
                              typename L::Storage* out, int64_t begin, int64_t end) {
  alignas(64) float m_hat[kNesterov ? kBlock : 1];
  for (int64_t at = begin; at < end; at += kBlock) {
    const int64_t n = std::min(kBlock, end - at);
    RowMomentsPass<G, kNesterov>(c, mu + at, nu + at, grad + at, m_hat, n);
    const float* m_src = kNesterov ? m_hat : mu + at;
    if constexpr (kMaster) {
      ApplyPass<kDecay, !kNesterov>(c, m_src, nu + at, master + at, n);
      CastPass<L>(master + at, out + at, n);
    } else {
      static_assert(std::is_same_v<L, F32>, "without a master the output is the f32 update");
      UpdatePass<kDecay, !kNesterov>(c, m_src, nu + at, param + at, out + at, n);
    }
  }
}

using RowFn = void (*)(const Coeffs&, const RowPointers&, int64_t, int64_t, bool);

// Elements [begin, end) of one subgroup row: a kernel for SelectIsa (adamw_common.h).
template <class G, class L, bool kMaster>
struct Row {
  using Fn = RowFn;
  template <bool kNesterov>
  static DOS_INLINE void Run(const Coeffs& c, const RowPointers& p, int64_t begin,
                             int64_t end, bool decay) {
    auto* grad = static_cast<const typename G::Storage*>(p.grad);
    auto* out = static_cast<typename L::Storage*>(p.out);
    if (decay) {
      RowRangeFixed<G, L, kMaster, kNesterov, true>(c, p.master, p.mu, p.nu, grad,
                                                    p.param, out, begin, end);
    } else {
      RowRangeFixed<G, L, kMaster, kNesterov, false>(c, p.master, p.mu, p.nu, grad,
                                                     p.param, out, begin, end);
    }
  }
};

// The master case writes the new master in the out dtype; without a master the out
// rows are the f32 update.
template <class G>
RowFn RowsForOut(bool has_master, ffi::DataType out, bool nesterov, int64_t isa) {
  if (!has_master) {
    return out == ffi::DataType::F32 ? SelectIsa<Row<G, F32, false>>(nesterov, isa)
                                     : nullptr;
  }
  switch (out) {
    case ffi::DataType::F32: return SelectIsa<Row<G, F32, true>>(nesterov, isa);
    case ffi::DataType::BF16: return SelectIsa<Row<G, BF16, true>>(nesterov, isa);
    case ffi::DataType::F16: return SelectIsa<Row<G, F16, true>>(nesterov, isa);
    default: return nullptr;
  }
}

inline RowFn SelectRows(ffi::DataType grad, bool has_master, ffi::DataType out, bool nesterov,
                 int64_t isa) {
  switch (grad) {
    case ffi::DataType::F32: return RowsForOut<F32>(has_master, out, nesterov, isa);
    case ffi::DataType::BF16: return RowsForOut<BF16>(has_master, out, nesterov, isa);
    default: return nullptr;
  }
}

}  // namespace dos_jax_host_adamw

#endif  // DOS_JAX_KERNELS_ADAMW_ROWS_H_
