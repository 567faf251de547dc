"""Optimizer state with a disk tier, checkpointed as files: one per subgroup.

`state_to_pytrees` unpacks a state whole in memory, which a disk tier exists to avoid:
its state does not fit there. `state_to_files` writes a state's subgroups into a folder
instead, each as the disk tier's own file format (`kernels.host_adamw_disk`): the disk
subgroups' files hard-linked (the disk tier never writes into a file: it replaces it,
so the link keeps this step's bytes), the subgroups in memory written. The returned
tree keeps each such state's scalars only, for orbax. `state_from_files` fills a state
freshly built by `init` (any split between disk and memory, the same subgroups) from
such a folder, one subgroup at a time: no more memory than the target's own tiers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterator

import jax
import numpy as np

from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.state import OffloadedState
from dos_jax.kernels import host_adamw_disk
from dos_jax.step import disk_tier
from dos_jax.step import state_init

PyTree = Any
_DESCRIPTION = 'states.json'


def _is_offloaded(x) -> bool:
  return isinstance(x, OffloadedState)


def _states(opt_state: PyTree) -> list[OffloadedState]:
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_offloaded) if _is_offloaded(x)]


def has_disk_tier(opt_state: PyTree) -> bool:
  """Whether `opt_state` holds a state with a disk tier that `state_to_files` can
  write: every offloaded state in it with one float32 array per subgroup (the disk
  tier's form), all of it addressable by this process."""
  states = _states(opt_state)
  return (any(s.partition.disk for s in states) and jax.process_count() == 1
          and all(_one_f32_group(s) for s in states))


def _one_f32_group(state: OffloadedState) -> bool:
  return len(state.slots.groups) == 1 and np.dtype(state.slots.groups[0]) == np.float32


def _shape(state: OffloadedState) -> dict:
  """What a target must share with the saved state: its subgroups and their rows."""
  layout = state.layout
  return {'num_subgroups': state.partition.num_subgroups,
          'num_slots': int(state.slots.group_sizes[0]),
          'subgroup_size': int(layout.subgroup_size),
          'leaves': [list(map(int, s)) for s in layout.shapes],
          'packing': _packing(layout)}


def _packing(layout) -> list:
  """How the rows hold the leaves: `[shards, each leaf's shard dimension]`, `[1, None]`
  leaf after leaf (`layout`'s module docstring)."""
  if layout.shards == 1:
    return [1, None]
  return [int(layout.shards), [None if d is None else int(d) for d in layout.shard_dims]]


def files_packing_mismatch(folder: str, template: PyTree) -> str | None:
  """Why `state_to_files`' `folder` cannot fill `template` as packed (a state saved
  on a mesh of another size, or in another program), or None. The rows of one packing
  hold other elements than another's, so a checkpoint of files resumes only into its
  own packing (a checkpoint of trees into any)."""
  with open(os.path.join(folder, _DESCRIPTION), encoding='utf-8') as f:
    shapes = json.load(f)['states']
  targets = [t for t in jax.tree.leaves(template, is_leaf=_is_offloaded) if _is_offloaded(t)]
  for shape, target in zip(shapes, targets):
    if (mismatch := _packing_mismatch(shape, target)) is not None:
      return mismatch
  return None


def _packing_mismatch(shape: dict, target: OffloadedState) -> str | None:
  mine, saved = _packing(target.layout), shape.get('packing', [1, None])
  if mine == saved:
    return None
  return (f'the checkpoint\'s optimizer state is packed {_packed_as(saved)}, this '
          f'run\'s {_packed_as(mine)}: resume on the mesh and program it was saved with')


def _packed_as(packing: list) -> str:
  if packing[0] == 1:
    return 'leaf after leaf (a state on one device, or split leaf-major)'
  return f'shard-major over {packing[0]} devices (ZeRO-3/ZeRO-1 on a mesh of that size)'


def state_files_tree(opt_state: PyTree) -> PyTree:
  """`opt_state` with each offloaded state replaced by `{'scalars': its scalars}`: the
  tree orbax saves beside the files (and the target it restores into)."""
  return jax.tree.map(lambda x: {'scalars': x.scalars} if _is_offloaded(x) else x,
                      opt_state, is_leaf=_is_offloaded)


def state_to_files(opt_state: PyTree, folder: str) -> PyTree:
  """Writes every offloaded state of `opt_state` into `folder/<i>/` (i: its index in
  flattening order), one file per subgroup; returns `state_files_tree(opt_state)`.

  Call it between steps: the links are to the disk tier's current files, which the
  step after next replaces. `folder` must not exist (it is made).

  Example (a state all on disk, saved, then restored with every subgroup in memory;
  the next step is the same, bit for bit):

  >>> import os, tempfile, jax, jax.numpy as jnp, numpy as np, dos_jax
  >>> tmp = tempfile.mkdtemp()
  >>> params = {'w': jnp.linspace(-1.0, 1.0, 300, dtype=jnp.bfloat16)}
  >>> grads = {'w': jnp.full((300,), 0.5, jnp.bfloat16)}
  >>> on_disk = dos_jax.adamw(0.1, offload=dos_jax.Offload(
  ...     subgroup_size=128, disk=dos_jax.Disk(os.path.join(tmp, 'state'))))
  >>> _, state = on_disk.update(grads, on_disk.init(params), params)
  >>> saved = dos_jax.state_to_files(state, os.path.join(tmp, 'ckpt'))
  >>> sorted(os.listdir(os.path.join(tmp, 'ckpt', '0')))  # subgroups 0-2, linked
  ['sg000000.0', 'sg000001.0', 'sg000002.0', 'shards.json']
  >>> in_memory = dos_jax.adamw(0.1, offload=dos_jax.Offload(subgroup_size=128))
  >>> restored = dos_jax.state_from_files(saved, os.path.join(tmp, 'ckpt'),
  ...                                     in_memory.init(params))
  >>> a, _ = on_disk.update(grads, state, params)
  >>> b, _ = in_memory.update(grads, restored, params)
  >>> bool(np.array_equal(a['w'], b['w']))
  True
  >>> import shutil; shutil.rmtree(tmp)
  """
  os.makedirs(folder)
  shapes = []
  for i, state in enumerate(_states(opt_state)):
    _write_state(state, os.path.join(folder, str(i)))
    shapes.append(_shape(state))
  with open(os.path.join(folder, _DESCRIPTION), 'w', encoding='utf-8') as f:
    json.dump({'states': shapes}, f)
  return state_files_tree(opt_state)


def _write_state(state: OffloadedState, folder: str) -> None:
  os.makedirs(folder)
  part = state.partition
  if part.disk:
    parity = int(state.disk_gen) % 2
    for g in part.disk:
      for shard in disk_tier.shard_ids(part):
        disk_tier.link_or_copy(disk_tier.live_path(part, g, parity, shard),
                               host_adamw_disk.state_path(folder, g, 0, shard))
  for tier in TIERS:
    blocks = part.blocks(tier)
    for ids, block in zip(blocks, partition_lib.blocks_of(state.tier(tier), len(blocks))):
      rows = np.asarray(jax.device_get(block[0]))
      for j, g in enumerate(ids):
        host_adamw_disk.write_state(folder, g, 0, rows[j])
  with open(os.path.join(folder, 'shards.json'), 'w', encoding='utf-8') as f:
    json.dump({'disk': list(part.disk), 'disk_shards': part.disk_shards}, f)


@contextlib.contextmanager
def restoring_state() -> Iterator[None]:
  """Inside, `init` builds a disk tier's state without writing its first generation:
  for a state a restore fills next (`state_from_files`, `state_from_pytrees` write or
  link every disk subgroup's files), so that a resumed run does not first write a
  generation it throws away. Stepping such a state before a restore fails on a missing
  file, naming it.

  >>> import os, tempfile, jax.numpy as jnp, dos_jax
  >>> tmp = tempfile.mkdtemp()
  >>> tx = dos_jax.adamw(0.1, offload=dos_jax.Offload(subgroup_size=128,
  ...                                                  disk=dos_jax.Disk(tmp)))
  >>> with dos_jax.restoring_state():
  ...   state = tx.init({'w': jnp.zeros(300)})
  >>> os.listdir(tmp), dos_jax.has_disk_tier(state)
  ([], True)
  """
  with state_init.shapes_only():
    yield


def state_from_files(saved: PyTree, folder: str, template: PyTree) -> PyTree:
  """`template` (a fresh `init`'s state, any split between disk and memory) filled from
  `state_to_files`' `folder` and the scalars restored from its returned tree (`saved`).

  Raises:
    ValueError: a state of `template` has other subgroups than the saved one (another
      subgroup size, model or param dtype), or packs them otherwise (another number of
      state shards), naming what differs.
  """
  with open(os.path.join(folder, _DESCRIPTION), encoding='utf-8') as f:
    shapes = json.load(f)['states']
  treedef = jax.tree.structure(template, is_leaf=_is_offloaded)
  leaves = treedef.flatten_up_to(saved)
  targets = [t for t in treedef.flatten_up_to(template) if _is_offloaded(t)]
  if len(shapes) != len(targets):
    raise ValueError(f'{folder} holds {len(shapes)} optimizer states; this optimizer has '
                     f'{len(targets)}')
  filled = iter(_fill(t, shape, os.path.join(folder, str(i)))
                for i, (t, shape) in enumerate(zip(targets, shapes)))
  out = []
  for target, leaf in zip(treedef.flatten_up_to(template), leaves):
    if _is_offloaded(target):  # leaf: {'scalars': ...}, restored by orbax
      scalars = tuple(jax.device_put(s, t.sharding)
                      for s, t in zip(leaf['scalars'], target.scalars, strict=True))
      leaf = dataclasses.replace(next(filled), scalars=scalars)
    out.append(leaf)
  return treedef.unflatten(out)


def _fill(target: OffloadedState, shape: dict, folder: str) -> OffloadedState:
  """`target`'s tiers and disk files from the saved subgroups in `folder`."""
  if not _one_f32_group(target):
    raise ValueError('the checkpoint holds the optimizer state as files of float32 rows; '
                     'this optimizer keeps moments of another dtype (set mu_dtype=None)')
  mine = _shape(target)
  for key in ('num_subgroups', 'num_slots', 'subgroup_size', 'leaves'):
    if mine[key] != shape[key]:
      what = ('other parameter shapes' if key == 'leaves'
              else f'{key}={shape[key]}, this run {mine[key]}')
      raise ValueError(f'the checkpoint\'s optimizer state has {what}: resume with the '
                       'offload.subgroup_size, model and param dtype it was saved with')
  if (mismatch := _packing_mismatch(shape, target)) is not None:
    raise ValueError(mismatch)
  with open(os.path.join(folder, 'shards.json'), encoding='utf-8') as f:
    saved = json.load(f)
  part, k, size = target.partition, mine['num_slots'], mine['subgroup_size']
  saved_shards = saved['disk_shards'] if saved['disk'] else 1
  read = lambda g: disk_tier.read_subgroup(folder, g, 0, k, size,
                                           saved_shards if g in saved['disk'] else 1)
  if part.disk:
    parity = int(target.disk_gen) % 2
    for g in part.disk:
      if g in saved['disk'] and saved_shards == part.disk_shards:
        disk_tier.link_copies(part, g, parity, lambda shard, g=g: host_adamw_disk.state_path(
            folder, g, 0, shard))
      else:
        disk_tier.write_rows(part, g, parity, read(g))
  tiers = {}
  for tier in TIERS:
    blocks = part.blocks(tier)
    arrays = partition_lib.blocks_of(target.tier(tier), len(blocks))
    tiers[tier] = tuple(
        jax.device_put(np.stack([read(g) for g in ids]).reshape(block[0].shape),
                       block[0].sharding) if ids else block[0]
        for ids, block in zip(blocks, arrays))
  return target.with_tiers(tiers, part)
