"""Layout-independent optimizer state, for checkpoints.

The packed `(G, S)` state depends on the subgroup size and the mesh; a checkpoint
should not. `state_to_pytrees` unpacks every offloaded state inside an optax state into
params-shaped pytrees (plus its scalars), and `state_from_pytrees` packs them again for
another optimizer, so a run can resume under a different policy or subgroup size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dos_jax import layout as layout_lib
from dos_jax import slots as slots_lib
from dos_jax.transform import OffloadedState

PyTree = Any


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _unpack_state(state: OffloadedState) -> dict[str, Any]:
  layout = state.layout
  master, inner = state.unstacked()

  def to_tree(x):
    if jnp.ndim(x) == 2:
      rows = jax.device_put(x, jax.memory.Space.Device)
      return layout.treedef.unflatten(layout_lib.unpack(rows, layout))
    return x

  return {'inner': jax.tree.map(to_tree, inner),
          'master': None if master is None else to_tree(master)}


def state_to_pytrees(opt_state: PyTree, params: PyTree) -> PyTree:
  """Replaces each `OffloadedState` in `opt_state` by params-shaped pytrees.

  Returns the same structure with every offloaded state turned into a dict
  `{'inner': ..., 'master': ...}` whose per-element leaves are pytrees shaped like
  `params` (in device memory) and whose scalars are kept as they are.
  """
  del params  # the layout inside each state says everything needed
  return jax.tree.map(
      lambda x: _unpack_state(x) if _is_offloaded(x) else x, opt_state, is_leaf=_is_offloaded
  )


def state_from_pytrees(trees: PyTree, params: PyTree, opt) -> PyTree:
  """Rebuilds `opt`'s state for `params` from `state_to_pytrees` output.

  `opt.init(params)` gives the target layout and placement (subgroup size, policy,
  mesh); the saved values are packed into it and placed like it.
  """
  template = opt.init(params)

  def rebuild(target, saved):
    if not _is_offloaded(target):
      return saved
    layout = target.layout
    target_master, target_inner = target.unstacked()

    def pack_like(t, s):
      if jnp.ndim(t) == 2:
        return layout_lib.pack(s, layout, t.dtype)
      return jnp.asarray(s, t.dtype)

    inner_leaves, inner_def = jax.tree.flatten(target_inner)
    saved_inner = inner_def.flatten_up_to(saved['inner']) if inner_leaves else []
    inner = inner_def.unflatten([pack_like(t, s) for t, s in zip(inner_leaves, saved_inner)])
    master = None
    if target_master is not None:
      source = saved['master'] if saved['master'] is not None else params
      master = pack_like(target_master, source)
    stacked, scalars = slots_lib.split((master, inner), target.slots, axis=1)
    return OffloadedState(
        stacked=tuple(jax.device_put(x, t.sharding) for x, t in zip(stacked, target.stacked)),
        scalars=tuple(jax.device_put(x, t.sharding) for x, t in zip(scalars, target.scalars)),
        layout=layout, slots=target.slots, resident=target.resident)

  return jax.tree.map(rebuild, template, trees, is_leaf=_is_offloaded)
