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
from dos_jax import paths
from dos_jax import slots as slots_lib
from dos_jax.transform import OffloadedState

PyTree = Any


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _unpack_state(state: OffloadedState) -> dict[str, Any]:
  """Unpacks in the state's own memory: host memory for an offloaded state, so a
  checkpoint never moves 12 bytes per parameter through the device."""
  layout = state.layout

  def unpack_all(stacked, scalars):
    master, inner = slots_lib.join(stacked, scalars, state.slots, axis=1)

    def to_tree(x):
      if jnp.ndim(x) == 2:
        return layout.treedef.unflatten(layout_lib.unpack(x, layout))
      return x

    return {'inner': jax.tree.map(to_tree, inner),
            'master': None if master is None else to_tree(master)}

  fn = unpack_all if state.resident else paths.on_host(unpack_all)
  return jax.jit(fn)(state.stacked, state.scalars)


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


def _move_rows(saved_inner: PyTree, template_inner: PyTree, move) -> PyTree:
  """Applies `move` to the per-element (params-shaped) parts of a saved inner state;
  scalars stay as they are."""
  targets, treedef = jax.tree.flatten(template_inner)
  sources = treedef.flatten_up_to(saved_inner) if targets else []
  return treedef.unflatten(
      [move(s) if len(t.shape) == 2 else s for t, s in zip(targets, sources)])


def state_from_pytrees(trees: PyTree, params: PyTree, opt) -> PyTree:
  """Rebuilds `opt`'s state for `params` from `state_to_pytrees` output.

  `opt.init(params)` gives the target layout and placement (subgroup size, policy,
  mesh); the saved values are packed into it and placed like it.
  """
  template = opt.init(params)

  def rebuild(target, saved):
    if not _is_offloaded(target):
      return saved
    layout, slots = target.layout, target.slots
    # Shapes and dtypes only: nothing of the template state is read.
    template_full = jax.eval_shape(
        lambda st, sc: slots_lib.join(st, sc, slots, axis=1), target.stacked, target.scalars)
    master_source = None
    if template_full[0] is not None:
      master_source = saved['master'] if saved['master'] is not None else params

    def pack_all(saved_inner, master_source):
      _, template_inner = template_full
      targets, treedef = jax.tree.flatten(template_inner)
      sources = treedef.flatten_up_to(saved_inner) if targets else []
      inner = treedef.unflatten([
          layout_lib.pack(s, layout, t.dtype) if jnp.ndim(t) == 2 else jnp.asarray(s, t.dtype)
          for t, s in zip(targets, sources)])
      master = None
      if master_source is not None:
        master = layout_lib.pack(master_source, layout, template_full[0].dtype)
      return slots_lib.split((master, inner), slots, axis=1)

    def build(saved_inner, master_source):
      # Packed where the state lives (host memory for an offloaded state, like init),
      # whatever memory the saved trees come from. 0-d leaves would drop their memory
      # space, and packing ravels every leaf anyway.
      space = paths.DEVICE if target.resident else paths.HOST
      move = lambda tree: paths.put(jax.tree.map(jnp.atleast_1d, tree), space)
      saved_inner = _move_rows(saved_inner, template_full[1], move)
      compute = pack_all if target.resident else paths.on_host(pack_all)
      return compute(saved_inner, move(master_source))

    out_shardings = (tuple(x.sharding for x in target.stacked),
                     tuple(x.sharding for x in target.scalars))
    stacked, scalars = jax.jit(build, out_shardings=out_shardings)(saved['inner'],
                                                                   master_source)
    return OffloadedState(stacked=stacked, scalars=scalars, layout=layout, slots=slots,
                          resident=target.resident)

  return jax.tree.map(rebuild, template, trees, is_leaf=_is_offloaded)
