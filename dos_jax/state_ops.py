"""Operations on whole optimizer states: a restore target, and a reset that keeps weights.

`abstract_state(tx, params)` is what to give orbax (or any restore) as the target: the
shapes, dtypes, shardings and memory kinds that `tx.init(params)` produces, so that an
offloaded state is restored straight into `pinned_host`, never through device memory.
(`jax.eval_shape(tx.init, params)` carries no memory kinds: orbax would restore the
whole state into device memory.)

`reset_moments(opt_state)` is the reset an optax user writes as
`jax.tree.map(jnp.zeros_like, opt_state)`. On an offloaded state that expression would
also zero the fp32 master weights kept for 16-bit params, and the next step would then
write zeros into the params. `reset_moments` zeroes the moments and step counts and
keeps the master. To start over from the params as they are (dropping the master's
extra precision), call `tx.init(params)` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dos_jax import memory_spaces
from dos_jax.step import state_init
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.state import OffloadedState

PyTree = Any


def abstract_state(tx: optax.GradientTransformation, params: PyTree) -> PyTree:
  """`tx.init(params)` as `jax.ShapeDtypeStruct`s with their shardings and memory kinds.

  Args:
    tx: the optimizer (any optax transform; offloaded ones place their state in
      `pinned_host`).
    params: the params, as arrays or as `jax.ShapeDtypeStruct`s with shardings.

  Returns:
    The state's structure with a `ShapeDtypeStruct` per array: a restore target, e.g.
    `orbax.checkpoint.StandardCheckpointer().restore(path, abstract_state(tx, params))`.
    Nothing is allocated: the init is only compiled, for its output shardings.
  """
  with state_init.shapes_only():  # a disk tier's init writes no file here
    shapes = jax.eval_shape(tx.init, params)
    shardings = jax.jit(tx.init).lower(params).compile().output_shardings
  return jax.tree.map(
      lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      shapes, shardings)


def _is_offloaded(x: Any) -> bool:
  return isinstance(x, OffloadedState)


def _zero_rows(x: jax.Array, keep: int | None) -> jax.Array:
  """`(R, K, S)` -> zeros except row `keep` of the middle axis, built where `x` is.

  `lax.pad` with a scalar fill, not a zeros array: a zeros array would be made in
  device memory, even inside a host computation (docs/design.md, "JAX facts").
  """
  k_all = x.shape[1]
  zero = jnp.zeros((), x.dtype)
  if keep is None:
    return jax.lax.pad(x[:, :0], zero, ((0, 0, 0), (0, k_all, 0), (0, 0, 0)))
  return jax.lax.pad(x[:, keep:keep + 1], zero,
                     ((0, 0, 0), (keep, k_all - keep - 1, 0), (0, 0, 0)))


def _reset(state: OffloadedState) -> OffloadedState:
  master = state.slots.places[0] if state.layout.needs_master else None
  host_program = jax.default_backend() != 'cpu'

  groups = len(state.slots.groups)

  def reset_tier(arrays):
    # Block-major arrays (see `partition.blocks_of`): array i holds dtype group i % groups.
    return tuple(_zero_rows(x, master[1] if master and master[0] == i % groups else None)
                 for i, x in enumerate(arrays))

  tiers = {}
  for tier, arrays in state.tiers.items():
    if not arrays:  # an empty tier stored per subgroup
      tiers[tier] = ()
      continue
    in_host = tier is not Tier.RESIDENT and host_program
    tiers[tier] = (memory_spaces.host_region(reset_tier) if in_host else reset_tier)(arrays)
  return dataclasses.replace(
      state, host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED],
      resident=tiers[Tier.RESIDENT], scalars=tuple(jnp.zeros_like(x) for x in state.scalars))


def reset_moments(opt_state: PyTree) -> PyTree:
  """Zeroes the optimizer's moments and step counts, keeping the fp32 master weights.

  Every `OffloadedState` in `opt_state` gets zero moments and counts (its master, kept
  for 16-bit params, is left as it is, in its memory); every other array is zeroed, as
  `jax.tree.map(jnp.zeros_like, opt_state)` would. The next step is then AdamW's first
  step from the current weights. Works eagerly and under jit.
  """
  def reset(x):
    if not _is_offloaded(x):
      return jnp.zeros_like(x)
    traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(x))
    if traced:
      return _reset(x)
    shardings = jax.tree.map(lambda a: a.sharding, x)
    return jax.jit(_reset, out_shardings=shardings)(x)

  return jax.tree.map(reset, opt_state, is_leaf=_is_offloaded)
