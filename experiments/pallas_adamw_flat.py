"""The fused AdamW over one flat subgroup, as a Pallas (Triton backend) kernel: a lab variant.

The library updates a subgroup's `(K, S)` state block in place
(`dos_jax.kernels.adamw_pallas_rows`); this kernel takes master, m and v as three flat
arrays instead. It stays here, out of the library, for what only the lab does with it:
experiments/bench_kernels.py measures it against device copies of the same bytes (the
numbers in experiments/notes/results_kernels*.md), and tests/test_kernels_pallas.py checks it
against optax and the block form against it. It computes with the library kernel's own
math (`pallas_adamw._adam_math`, the IEEE division and square root), so both stay one
computation.

  from experiments import pallas_adamw_flat       # from the repository root
  import pallas_adamw_flat                        # from a script in experiments/
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from dos_jax.kernels import adamw_scalars
from dos_jax.kernels import pallas_adamw
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.pallas_adamw import BlockConfig
from dos_jax.kernels.pallas_adamw import DEFAULT_CONFIG

# pylint: disable=protected-access  (the library kernel's math, shared on purpose)

# The pure-jnp reference of this kernel is the library's (same arguments).
adamw_reference = pallas_adamw.adamw_reference


def _adamw_kernel(
    coeffs_ref, limit_ref, master_ref, mu_ref, nu_ref, grad_ref, *refs,
    size: int, block_size: int, nesterov: bool, exact_ops: bool, has_lowp: bool):
  # refs: [lowp_in_ref (only aliased, never read)], then the outputs master, mu, nu
  # (aliased to their inputs) and, unless lowp_dtype is None, lowp.
  master_out_ref, mu_out_ref, nu_out_ref, *lowp_ref = refs[-4:] if has_lowp else refs[-3:]
  idx = pl.program_id(0) * block_size + jnp.arange(block_size, dtype=jnp.int32)
  in_bounds = idx < size  # the last block may run past the end: mask, never pad
  load = functools.partial(plgpu.load, mask=in_bounds, other=0)
  coeffs = adamw_scalars.Coefficients(
      *(coeffs_ref[i] for i in range(len(adamw_scalars.Coefficients._fields))))
  new_master, new_mu, new_nu = pallas_adamw._adam_math(
      coeffs, load(master_ref), load(mu_ref), load(nu_ref), load(grad_ref),
      idx < limit_ref[0], nesterov=nesterov,
      div=pallas_adamw._ieee_div if exact_ops else jnp.divide,
      sqrt=pallas_adamw._ieee_sqrt if exact_ops else jnp.sqrt)
  store = functools.partial(plgpu.store, mask=in_bounds)
  store(master_out_ref, new_master)
  store(mu_out_ref, new_mu.astype(mu_out_ref.dtype))
  store(nu_out_ref, new_nu)
  if has_lowp:
    store(lowp_ref[0], new_master.astype(lowp_ref[0].dtype))


@functools.partial(
    jax.jit, static_argnames=('lowp_dtype', 'nesterov', 'config', 'interpret'))
def _adamw_call(packed, limit, master, mu, nu, grad, lowp_out, *, lowp_dtype, nesterov,
                config, interpret):
  size = master.shape[0]
  block = config.block_size
  kernel = functools.partial(
      _adamw_kernel, size=size, block_size=block, nesterov=nesterov,
      exact_ops=not interpret, has_lowp=lowp_dtype is not None)
  state_spec = pl.BlockSpec((block,), lambda i: (i,))
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))
  reuse = lowp_out is not None
  out_shape = [
      jax.ShapeDtypeStruct(master.shape, master.dtype),
      jax.ShapeDtypeStruct(mu.shape, mu.dtype),
      jax.ShapeDtypeStruct(nu.shape, nu.dtype),
  ] + ([] if lowp_dtype is None else [jax.ShapeDtypeStruct(master.shape, lowp_dtype)])
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(size, block),),
      in_specs=([whole(adamw_scalars.NUM_SLOTS), whole(1)] +
                [state_spec] * (5 if reuse else 4)),
      out_specs=[state_spec] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases={2: 0, 3: 1, 4: 2, **({6: 3} if reuse else {})},
      compiler_params=plgpu.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name='dos_jax_adamw',
  )(packed, limit, master, mu, nu, grad, *([lowp_out] if reuse else []))
  return (*out[:3], out[3] if lowp_dtype is not None else None)


def adamw_pallas(master, mu, nu, grad, scalars: AdamWScalars, *, decay_limit,
                 lowp_dtype: Any, nesterov: bool = False,
                 config: BlockConfig = DEFAULT_CONFIG, interpret: bool = False,
                 lowp_out=None):
  """One AdamW step on a flat subgroup, fused into one Pallas kernel.

  Args:
    master: f32[S] master weights; updated in place (aliased to the first output).
    mu: f32[S] or bf16[S] first moment; updated in place.
    nu: f32[S] second moment; updated in place.
    grad: f32[S] or bf16[S] gradient, multiplied by `scalars.grad_scale` first.
    scalars: the step's `AdamWScalars`.
    decay_limit: int32 scalar (may be traced); weight decay applies to indices below it.
    lowp_dtype: dtype of the parameter copy written in the same pass (bf16, f16, f32),
      or None for no copy (then the fourth result is None).
    nesterov: optax's Nesterov variant (needs `scalars.bc1_next`).
    config: block sizes.
    interpret: run the kernel in the Pallas interpreter (any backend, CPU included).
    lowp_out: optional dead array of shape (S,) and dtype `lowp_dtype` (e.g. last
      step's low-precision params), aliased to the low-precision result so that a
      donated call allocates nothing.

  Returns:
    (new_master, new_mu, new_nu, new_master.astype(lowp_dtype) or None).
  """
  adamw_scalars.check_inputs(master, mu, nu, grad, decay_limit, lowp_dtype, lowp_out)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  limit = jnp.reshape(jnp.asarray(decay_limit, jnp.int32), (1,))
  return _adamw_call(packed, limit, master, mu, nu, grad, lowp_out,
                     lowp_dtype=None if lowp_dtype is None else jnp.dtype(lowp_dtype),
                     nesterov=nesterov,
                     config=config, interpret=interpret)
