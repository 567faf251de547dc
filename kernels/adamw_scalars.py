"""Per-step AdamW scalars shared by the reference, the Pallas kernel and the host kernel.

The caller evaluates schedules and bias corrections in jnp (exactly as optax does) and
hands them over in an `AdamWScalars`. `coefficients` turns them into the f32 constants
every implementation multiplies by, computed once in the same way for all three, so
the kernels and the reference agree bit for bit and agree with `jax.jit(optax.adamw)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Number of f32 slots in the packed coefficient vector handed to the kernels (a power of
# two so that the Triton backend can load it as one block).
NUM_SLOTS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdamWScalars:
  """The scalars of one AdamW step; each an f32 0-d array or a Python float.

  Pass b1 and b2 as optax receives them (normally Python floats): `1 - b1` is then
  computed in double precision and rounded once, as optax does, and results can match
  `jax.jit(optax.adamw)` bit for bit.
  """

  lr: Any  # learning rate of this step (schedule already evaluated)
  b1: Any  # decay rate of the first moment
  b2: Any  # decay rate of the second moment
  eps: Any  # added to sqrt(nu_hat), outside the square root
  eps_root: Any  # added to nu_hat, inside the square root
  weight_decay: Any  # decoupled weight decay rate (multiplied by lr like the rest)
  bc1: Any  # 1 - b1**count, count = the incremented step count, computed as optax does
  bc2: Any  # 1 - b2**count
  grad_scale: Any = 1.0  # gradients are multiplied by this first (global-norm clipping)
  bc1_next: Any = None  # 1 - b1**(count + 1); needed only with nesterov=True


class Coefficients(NamedTuple):
  """f32 0-d constants of one step, derived once from `AdamWScalars`."""

  neg_lr: jax.Array  # -lr: optax scales by (-1 * lr)
  b1: jax.Array
  one_minus_b1: jax.Array
  b2: jax.Array
  one_minus_b2: jax.Array
  eps: jax.Array
  eps_root: jax.Array
  weight_decay: jax.Array
  inv_bc1: jax.Array  # 1 / bc1: XLA rewrites `x / scalar` as `x * (1 / scalar)`
  inv_bc2: jax.Array  # 1 / bc2
  grad_scale: jax.Array
  inv_bc1_next: jax.Array  # 1 / bc1_next, or 0 without nesterov


def _f32(x: Any) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


def _one_minus(x: Any) -> jax.Array:
  # optax writes `(1 - decay)`: for a Python float that is a double subtraction rounded
  # once to f32; for an array it is an f32 subtraction. Both differ in the last bit.
  if isinstance(x, (int, float)):
    return _f32(1.0 - x)
  return 1 - _f32(x)


def _reciprocal(x: Any) -> jax.Array:
  return jnp.float32(1) / _f32(x)


def coefficients(scalars: AdamWScalars, *, nesterov: bool) -> Coefficients:
  """Derives the f32 constants of a step from `scalars`."""
  if not isinstance(scalars, AdamWScalars):
    raise TypeError(f'scalars must be an AdamWScalars, got {type(scalars).__name__}')
  if nesterov and scalars.bc1_next is None:
    raise ValueError('nesterov=True needs AdamWScalars.bc1_next = 1 - b1**(count + 1)')
  return Coefficients(
      neg_lr=-_f32(scalars.lr),
      b1=_f32(scalars.b1),
      one_minus_b1=_one_minus(scalars.b1),
      b2=_f32(scalars.b2),
      one_minus_b2=_one_minus(scalars.b2),
      eps=_f32(scalars.eps),
      eps_root=_f32(scalars.eps_root),
      weight_decay=_f32(scalars.weight_decay),
      inv_bc1=_reciprocal(scalars.bc1),
      inv_bc2=_reciprocal(scalars.bc2),
      grad_scale=_f32(scalars.grad_scale),
      inv_bc1_next=(_reciprocal(scalars.bc1_next) if nesterov else jnp.float32(0)),
  )


def pack(coeffs: Coefficients) -> jax.Array:
  """Stacks `coeffs` into the f32[NUM_SLOTS] vector the kernels read (order = fields)."""
  values = [jnp.reshape(_f32(c), ()) for c in coeffs]
  pad = [jnp.float32(0)] * (NUM_SLOTS - len(values))
  return jnp.stack(values + pad)


def check_inputs(master, mu, nu, grad, decay_limit, lowp_dtype, lowp_out=None) -> None:
  """Raises a one-line error naming the argument that breaks the kernel contract."""
  if jnp.ndim(master) != 1 or master.shape[0] < 1:
    raise ValueError(f'master must be a non-empty 1-D array, got shape {jnp.shape(master)}')
  for name, x, dtypes in (
      ('master', master, (jnp.float32,)),
      ('mu', mu, (jnp.float32, jnp.bfloat16)),
      ('nu', nu, (jnp.float32,)),
      ('grad', grad, (jnp.float32, jnp.bfloat16)),
  ):
    if x.shape != master.shape:
      raise ValueError(f'{name} has shape {x.shape}, master has {master.shape}')
    if x.dtype not in [jnp.dtype(d) for d in dtypes]:
      allowed = ', '.join(jnp.dtype(d).name for d in dtypes)
      raise ValueError(f'{name} has dtype {x.dtype}; supported: {allowed}')
  if lowp_dtype is not None and jnp.dtype(lowp_dtype) not in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise ValueError(
        f'lowp_dtype must be bfloat16, float16, float32 or None, got {lowp_dtype}')
  if lowp_out is not None and (lowp_dtype is None or lowp_out.shape != master.shape or
                                lowp_out.dtype != jnp.dtype(lowp_dtype)):
    want = 'None' if lowp_dtype is None else f'{jnp.dtype(lowp_dtype).name}{list(master.shape)}'
    raise ValueError(f'lowp_out must be {want}, got {lowp_out.dtype.name}{list(lowp_out.shape)}')
  if jnp.ndim(decay_limit) != 0:
    raise ValueError(f'decay_limit must be a scalar, got shape {jnp.shape(decay_limit)}')
