"""Layout-independent optimizer state, for checkpoints.

The packed `(G, S)` state depends on the subgroup size and the mesh; a checkpoint
should not. `state_to_pytrees` unpacks every offloaded state inside an optax state into
params-shaped pytrees (plus its scalars), and `state_from_pytrees` packs them again for
another optimizer, so a run can resume under a different policy or subgroup size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry import slots as slots_lib
from dos_jax.geometry import disk_files
from dos_jax import memory_spaces
from dos_jax.memory_spaces import DEVICE
from dos_jax.memory_spaces import HOST
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.state import OffloadedState

PyTree = Any


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _in_host_memory(fn, resident: bool):
  """`fn` where an offloaded state lives: in a host region when the program has them."""
  if resident or jax.default_backend() == 'cpu':
    return fn
  return memory_spaces.host_region(fn)


def _unpack_state(state: OffloadedState) -> dict[str, Any]:
  """Unpacks in the state's own memory: host memory for an offloaded state, so a
  checkpoint never moves 12 bytes per parameter through the device."""
  layout = state.layout
  if state.partition.disk:
    return _unpack_with_disk(state)
  resident = not (state.partition.host or state.partition.streamed)
  space = DEVICE if resident else HOST

  def unpack_all(tiers, scalars):
    rows = partition_lib.merge_tiers(tiers, state.partition)
    return _as_trees(*slots_lib.join(rows, scalars, state.slots, axis=1), layout)

  tiers = {t: memory_spaces.put(arrays, space) for t, arrays in state.tiers.items()}
  scalars = state.scalars if resident else memory_spaces.to_host(state.scalars)
  return jax.jit(_in_host_memory(unpack_all, resident))(tiers, scalars)


def _unpack_with_disk(state: OffloadedState) -> dict[str, Any]:
  """A state with a disk tier, unpacked from its files and arrays read back whole
  (`OffloadedState.rows`): the state must fit in memory once."""
  return _as_trees(*slots_lib.join(state.rows(), state.scalars, state.slots, axis=1),
                   state.layout)


def _as_trees(master, inner, layout) -> dict[str, Any]:
  """`{'inner', 'master'}` with every `(G, S)` leaf unpacked into a params-shaped tree."""
  def to_tree(x):
    if jnp.ndim(x) == 2:
      return layout.treedef.unflatten(layout_lib.unpack(x, layout))
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


def pytree_targets(opt_state: PyTree, params: PyTree) -> PyTree:
  """What `state_to_pytrees(opt_state, params)` gives, as restore targets: a state with a
  disk tier as `jax.ShapeDtypeStruct`s, its per-element leaves placed like `params`
  and its scalars replicated, without reading its files (a run being restored has
  written none, `dos_jax.restoring_state`); any other state unpacked as
  `state_to_pytrees` does."""
  def target(x):
    if not _is_offloaded(x):
      return x
    return _disk_targets(x, params) if x.partition.disk else _unpack_state(x)

  return jax.tree.map(target, opt_state, is_leaf=_is_offloaded)


def _disk_targets(state: OffloadedState, params: PyTree) -> dict[str, Any]:
  layout = state.layout
  rows = tuple(jax.ShapeDtypeStruct((state.partition.num_subgroups, k, layout.subgroup_size),
                                    jnp.dtype(g))
               for g, k in zip(state.slots.groups, state.slots.group_sizes))
  master, inner = jax.eval_shape(lambda r, s: slots_lib.join(r, s, state.slots, axis=1),
                                 rows, state.scalars)
  shardings = [getattr(p, 'sharding', None) for p in layout.treedef.flatten_up_to(params)]
  first = next((s for s in shardings if s is not None), None)
  if isinstance(first, jax.sharding.NamedSharding):
    whole = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
  else:
    whole = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def to_target(x):
    if len(x.shape) == 2:  # a (G, S) per-element leaf: params-shaped
      return layout.treedef.unflatten([
          jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=sh or whole)
          for shape, sh in zip(layout.shapes, shardings)])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole)

  return {'inner': jax.tree.map(to_target, inner),
          'master': None if master is None else to_target(master)}


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
    layout, slots, part = target.layout, target.slots, target.partition
    resident = not (part.host or part.streamed)
    # Shapes and dtypes only (not memory spaces, which differ between the tiers):
    # nothing of the template state is read.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          (target.tiers, target.scalars))
    if part.disk:  # the whole state's rows, the disk tier's included
      rows = tuple(jax.ShapeDtypeStruct((part.num_subgroups, k, layout.subgroup_size),
                                        jnp.dtype(g))
                   for g, k in zip(slots.groups, slots.group_sizes))
      template_full = jax.eval_shape(
          lambda rows, sc: slots_lib.join(rows, sc, slots, axis=1), rows, shapes[1])
    else:
      template_full = jax.eval_shape(
          lambda tiers, sc: slots_lib.join(partition_lib.merge_tiers(tiers, part), sc, slots,
                                           axis=1), *shapes)
    master_source = None
    if template_full[0] is not None:
      master_source = saved['master'] if saved['master'] is not None else params

    def pack_rows(saved_inner, master_source):
      """`((G, K, S) rows per dtype, scalars)` in subgroup order."""
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

    def pack_all(saved_inner, master_source):
      rows, scalars = pack_rows(saved_inner, master_source)
      return partition_lib.split_tiers(rows, part), scalars

    def build(saved_inner, master_source):
      # Packed where the state lives (host memory for an offloaded state, like init),
      # whatever memory the saved trees come from. 0-d leaves would drop their memory
      # space, and packing ravels every leaf anyway.
      space = DEVICE if resident else HOST
      move = lambda tree: memory_spaces.put(jax.tree.map(jnp.atleast_1d, tree), space)
      saved_inner = _move_rows(saved_inner, template_full[1], move)
      return _in_host_memory(pack_all, resident)(saved_inner, move(master_source))

    out_shardings = ({t: tuple(x.sharding for x in arrays)
                      for t, arrays in target.tiers.items()},
                     tuple(x.sharding for x in target.scalars))
    if part.disk:
      def whole_rows(saved_inner, master_source):  # in device memory: all of the state
        move = lambda tree: memory_spaces.put(jax.tree.map(jnp.atleast_1d, tree), DEVICE)
        return pack_rows(_move_rows(saved_inner, template_full[1], move), move(master_source))

      return _rebuild_with_disk(target, whole_rows, saved['inner'], master_source,
                                out_shardings)
    tiers, scalars = jax.jit(build, out_shardings=out_shardings)(saved['inner'], master_source)
    return dataclasses.replace(target, host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED],
                               resident=tiers[Tier.RESIDENT], scalars=scalars)

  return jax.tree.map(rebuild, template, trees, is_leaf=_is_offloaded)


def _rebuild_with_disk(target: OffloadedState, pack_rows, saved_inner, master_source,
                       out_shardings) -> OffloadedState:
  """`target` (with a disk tier) filled from saved trees: packed whole in memory (the
  state must fit there once), the disk subgroups' rows written to their files at the
  target's generation, the others placed like the target's arrays. In a run of several
  processes the rows are packed split over the state's mesh axis and each process
  writes its own devices' files."""
  part = target.partition
  mesh = next((sh.mesh for sh in jax.tree.leaves(out_shardings)
               if isinstance(sh, jax.sharding.NamedSharding)), None)
  if jax.process_count() > 1 and mesh is not None and part.disk_axis is not None:
    rows, scalars = _pack_split(pack_rows, saved_inner, master_source, mesh, part.disk_axis)
    disk_files.write_split_rows(part, target.disk_gen, rows[0], mesh)
    tiers, scalars = jax.jit(lambda r, s: (partition_lib.split_tiers(r, part), s),
                             out_shardings=out_shardings)(rows, scalars)
  else:
    # Packed whole in one device's memory, then placed like the target.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind='device')
    rows, scalars = jax.jit(pack_rows)(
        *jax.tree.map(lambda x: jax.device_put(x, one), (saved_inner, master_source)))
    half = disk_files.parity(target.disk_gen)
    for g in part.disk:
      disk_files.write_rows(part, g, half, np.asarray(rows[0][g]))
    tiers = partition_lib.split_tiers(rows, part)
    tiers = {t: tuple(jax.device_put(x, sh) for x, sh in zip(tiers[t], out_shardings[0][t]))
             for t in tiers}
    scalars = tuple(jax.device_put(x, sh) for x, sh in zip(scalars, out_shardings[1]))
  return dataclasses.replace(target, host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED],
                             resident=tiers[Tier.RESIDENT], scalars=scalars)


def _pack_split(pack_rows, saved_inner, master_source, mesh, axis: str):
  """`pack_rows` over the processes' devices: the `(G, K, S)` rows split by columns over
  `axis` (each data shard's columns on its devices), the scalars whole."""
  cols = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, axis))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(pack_rows, out_shardings=(cols, whole))(saved_inner, master_source)

