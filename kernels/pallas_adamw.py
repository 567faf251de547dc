"""The Pallas AdamW: one subgroup's `(K, S)` state block in one pass (Triton backend).

One pass reads the block's fp32 master weights, m, v and the gradient (bf16 or fp32), and
writes the new master, m, v in place plus the low-precision parameter copy. XLA already fuses an
elementwise AdamW; what this kernel adds is the in-place update (`input_output_aliases`),
the 16-bit weight output in the same pass and the gradient scale folded in.

The math follows `optax.adamw` op for op (see `adamw_reference`), with divisions by the
per-step bias corrections done as multiplications by their f32 reciprocals, as XLA
compiles optax on a flat array. Results agree with `jax.jit(optax.adamw)` to an ulp
(rtol 1e-6); where exactly XLA or Triton contracts a product and a sum into an FMA
varies between programs, so bits may differ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
# Imported now, not on first use: Pallas's interpret mode imports it at a kernel's first
# run, and the option it registers is part of jit's trace context on jax 0.12, so a jitted
# step traced before that run would compile again at its next call.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  pylint: disable=unused-import
import jax.numpy as jnp

from dos_jax.kernels import adamw_scalars
from dos_jax.kernels.adamw_scalars import AdamWScalars

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """How a subgroup's elements are cut into Triton programs."""

  block_size: int = 2048  # elements per program; a power of two (Triton needs one)
  num_warps: int = 4  # 128 threads x 16 elements: enough bytes in flight per SM
  num_stages: int = 1  # no inner loop to pipeline

  def __post_init__(self):
    for name in ('block_size', 'num_warps'):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f'BlockConfig.{name} must be a power of two, got {value}')
    if self.num_stages < 1:
      raise ValueError(f'BlockConfig.num_stages must be >= 1, got {self.num_stages}')


DEFAULT_CONFIG = BlockConfig()


def _adam_math(coeffs, master, mu, nu, grad, decayed, *, nesterov, div, sqrt):
  """The AdamW update in optax's op order, shared by the kernel and the reference.

  The order of every product and sum matters: XLA contracts `a * b + c` into an FMA
  for the first product of a sum, and matching that is what makes results bit-equal.
  """
  c = coeffs
  g = grad.astype(_F32) * c.grad_scale
  mu = c.one_minus_b1 * g + c.b1 * mu.astype(_F32)  # optax update_moment
  nu = c.one_minus_b2 * (g * g) + c.b2 * nu  # optax update_moment_per_elem_norm
  if nesterov:
    mu_hat = c.b1 * (mu * c.inv_bc1_next) + c.one_minus_b1 * (g * c.inv_bc1)
  else:
    mu_hat = mu * c.inv_bc1
  nu_hat = nu * c.inv_bc2
  u = div(mu_hat, sqrt(nu_hat + c.eps_root) + c.eps)
  u = jnp.where(decayed, u + c.weight_decay * master, u)  # optax add_decayed_weights
  new_master = master + c.neg_lr * u  # scale_by_learning_rate, then apply_updates
  return new_master, mu, nu


def _ieee_div(x, y):
  # Triton lowers f32 `/` to div.full.f32 (2 ulp); XLA divides exactly.
  [out] = plgpu.elementwise_inline_asm(
      'div.rn.f32 $0, $1, $2;', args=[x, y], constraints='=f,f,f', pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, _F32)])
  return out


def _ieee_sqrt(x):
  [out] = plgpu.elementwise_inline_asm(
      'sqrt.rn.f32 $0, $1;', args=[x], constraints='=f,f', pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, _F32)])
  return out


def _adamw_rows_kernel(
    coeffs_ref, limit_ref, state_ref, grad_ref, *refs, slots: tuple[int, int, int],
    size: int, block_size: int, nesterov: bool, exact_ops: bool, has_param: bool,
    has_lowp: bool):
  # refs: [param_ref (only without a master slot)], then the outputs: the state block
  # (aliased to its input), [the new master (only without a master slot)], [lowp].
  param_ref = refs[0] if has_param else None
  state_out_ref, *outs = refs[1:] if has_param else refs
  master_out_ref = outs.pop(0) if has_param else None
  master_k, mu_k, nu_k = slots
  idx = pl.program_id(0) * block_size + jnp.arange(block_size, dtype=jnp.int32)
  in_bounds = idx < size
  load = functools.partial(plgpu.load, mask=in_bounds, other=0)
  store = functools.partial(plgpu.store, mask=in_bounds)
  coeffs = adamw_scalars.Coefficients(
      *(coeffs_ref[i] for i in range(len(adamw_scalars.Coefficients._fields))))
  # Row indices as int32 scalars (Pallas' loads take array indices, not Python ints).
  row = lambda k: state_ref.at[jnp.int32(k)]
  out_row = lambda k: state_out_ref.at[jnp.int32(k)]
  master = load(param_ref) if has_param else load(row(master_k))
  new_master, new_mu, new_nu = _adam_math(
      coeffs, master, load(row(mu_k)), load(row(nu_k)), load(grad_ref),
      idx < limit_ref[0], nesterov=nesterov,
      div=_ieee_div if exact_ops else jnp.divide,
      sqrt=_ieee_sqrt if exact_ops else jnp.sqrt)
  store(master_out_ref if has_param else out_row(master_k), new_master)
  store(out_row(mu_k), new_mu.astype(state_out_ref.dtype))
  store(out_row(nu_k), new_nu)
  if has_lowp:
    store(outs[0], new_master.astype(outs[0].dtype))


@functools.partial(
    jax.jit, static_argnames=('slots', 'lowp_dtype', 'nesterov', 'config', 'interpret'))
def _adamw_rows_call(packed, limit, state, grad, param, *, slots, lowp_dtype, nesterov,
                     config, interpret):
  rows, size = state.shape
  block = config.block_size
  has_param = param is not None
  kernel = functools.partial(
      _adamw_rows_kernel, slots=slots, size=size, block_size=block, nesterov=nesterov,
      exact_ops=not interpret, has_param=has_param, has_lowp=lowp_dtype is not None)
  # Every row of the block's columns i: master (if stored), mu and nu of one element
  # range together, so one program reads and writes them all in place.
  block_spec = pl.BlockSpec((rows, block), lambda i: (0, i))
  row_spec = pl.BlockSpec((block,), lambda i: (i,))
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))
  out_shape = [jax.ShapeDtypeStruct(state.shape, state.dtype)]
  if has_param:
    out_shape.append(jax.ShapeDtypeStruct((size,), jnp.float32))
  if lowp_dtype is not None:
    out_shape.append(jax.ShapeDtypeStruct((size,), lowp_dtype))
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(size, block),),
      in_specs=[whole(adamw_scalars.NUM_SLOTS), whole(1), block_spec, row_spec]
      + ([row_spec] if has_param else []),
      out_specs=[block_spec] + [row_spec] * (len(out_shape) - 1),
      out_shape=out_shape,
      input_output_aliases={2: 0},
      compiler_params=plgpu.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name='dos_jax_adamw_rows',
  )(packed, limit, state, grad, *([param] if has_param else []))
  new_state, rest = out[0], list(out[1:])
  new_master = rest.pop(0) if has_param else None
  return new_state, new_master, rest[0] if lowp_dtype is not None else None


def adamw_pallas_rows(state, grad, scalars: AdamWScalars, *, slots: tuple[int, int, int],
                      decay_limit, lowp_dtype: Any, param=None, nesterov: bool = False,
                      config: BlockConfig = DEFAULT_CONFIG, interpret: bool = False):
  """One AdamW step on a subgroup's `(K, S)` state block, in place, in one Pallas kernel.

  The form the device path uses: a streamed or resident row's block arrives whole, and
  slicing it into master, mu and nu for a kernel over flat arrays (and stacking the
  results) would make XLA materialize two more copies of it per row in flight. Here
  the kernel reads and writes the block where it is (`input_output_aliases`), so a row
  in flight holds its block, its gradient and the new low-precision row.

  Args:
    state: f32[K, S]: rows `slots` hold master (if any), mu and nu; updated in place.
    grad: f32[S] or bf16[S] gradient, multiplied by `scalars.grad_scale` first.
    scalars: the step's `AdamWScalars`.
    slots: `(master_k or -1, mu_k, nu_k)`, the rows of the block; -1: no master row,
      the params (`param`, f32) are their own master.
    decay_limit: int32 scalar (may be traced); weight decay applies below it.
    lowp_dtype: dtype of the parameter copy written in the same pass, or None.
    param: f32[S], the params, when there is no master row.
    nesterov: optax's Nesterov variant (needs `scalars.bc1_next`).
    config: block sizes.
    interpret: run the kernel in the Pallas interpreter (any backend, CPU included).

  Returns:
    (new state block, new master f32[S] if `param` is given else None, new low-precision
    params or None); the values of `adamw_reference` on the block's rows, to an ulp.
  """
  master_k, mu_k, nu_k = slots
  if jnp.ndim(state) != 2 or state.dtype != jnp.dtype(jnp.float32):
    raise ValueError(f'state must be a float32 (K, S) block, got {state.dtype}{list(state.shape)}')
  if (master_k < 0) != (param is not None):
    raise ValueError('param must be given exactly when the block has no master row')
  rows = [k for k in slots if k >= 0]
  if len(set(rows)) != len(rows) or not all(0 <= k < state.shape[0] for k in rows):
    raise ValueError(f'slots {slots} are not distinct rows of a block of {state.shape[0]}')
  master = param if param is not None else state[master_k]
  adamw_scalars.check_inputs(master, state[mu_k], state[nu_k], grad, decay_limit,
                             lowp_dtype)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  limit = jnp.reshape(jnp.asarray(decay_limit, jnp.int32), (1,))
  return _adamw_rows_call(packed, limit, state, grad, param, slots=tuple(slots),
                          lowp_dtype=None if lowp_dtype is None else jnp.dtype(lowp_dtype),
                          nesterov=nesterov, config=config, interpret=interpret)


def packed_scalars(scalars: AdamWScalars, *, nesterov: bool = False) -> jax.Array:
  """The f32 vector of one step's AdamW coefficients that the kernel reads."""
  return adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))


def adamw_pallas_rows_packed(packed, limit, state, grad, param=None, *, slots, lowp_dtype,
                             nesterov: bool = False, config: BlockConfig = DEFAULT_CONFIG,
                             interpret: bool = False):
  """`adamw_pallas_rows` with its coefficients already packed (`packed_scalars`) and its
  decay limit an int32 `(1,)` array: every input an operand, so a caller can compute them
  elsewhere (a GPU stream region on jax 0.12 must hold no constant). Same results."""
  return _adamw_rows_call(packed, limit, state, grad, param, slots=tuple(slots),
                          lowp_dtype=None if lowp_dtype is None else jnp.dtype(lowp_dtype),
                          nesterov=nesterov, config=config, interpret=interpret)


def adamw_reference(master, mu, nu, grad, scalars: AdamWScalars, *, decay_limit,
                    lowp_dtype: Any, nesterov: bool = False):
  """Pure-jnp AdamW step on one subgroup's flat rows: the semantics of `adamw_pallas_rows`.

  Args:
    master: f32[S] master weights (the block's master row, or the params).
    mu: f32[S] or bf16[S] first moment.
    nu: f32[S] second moment.
    grad: f32[S] or bf16[S] gradient, multiplied by `scalars.grad_scale` first.
    scalars: the step's `AdamWScalars`.
    decay_limit: int32 scalar (may be traced); weight decay applies to indices below it.
    lowp_dtype: dtype of the parameter copy (bf16, f16, f32), or None for no copy.
    nesterov: optax's Nesterov variant (needs `scalars.bc1_next`).

  Returns:
    (new_master, new_mu, new_nu, new_master.astype(lowp_dtype) or None).
  """
  adamw_scalars.check_inputs(master, mu, nu, grad, decay_limit, lowp_dtype)
  coeffs = adamw_scalars.coefficients(scalars, nesterov=nesterov)
  decayed = jnp.arange(master.shape[0], dtype=jnp.int32) < decay_limit
  new_master, new_mu, new_nu = _adam_math(
      coeffs, master, mu, nu, grad, decayed, nesterov=nesterov, div=jnp.divide,
      sqrt=jnp.sqrt)
  lowp = None if lowp_dtype is None else new_master.astype(lowp_dtype)
  return new_master, new_mu.astype(mu.dtype), new_nu, lowp
