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
from jax.experimental import multihost_utils

from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.state import OffloadedState
from dos_jax.kernels import host_adamw_disk
from dos_jax.geometry import disk_files
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
  tier's form). In a run of several processes each writes its own devices' part."""
  states = _states(opt_state)
  return any(s.partition.disk for s in states) and all(_one_f32_group(s) for s in states)


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

  In a run of several processes every process calls it, with the same `folder` (one
  file system, as orbax assumes): each writes the files of its own devices' shards
  (the first copy of each data shard once, the subgroups in memory from its
  addressable shards), process 0 the descriptions; it returns when all are written.

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
  lead = jax.process_index() == 0
  if lead:
    os.makedirs(folder)
  _sync(f'dos_jax.state_to_files:made:{folder}')
  shapes = []
  for i, state in enumerate(_states(opt_state)):
    _write_state(state, os.path.join(folder, str(i)), lead)
    shapes.append(_shape(state))
  if lead:
    with open(os.path.join(folder, _DESCRIPTION), 'w', encoding='utf-8') as f:
      json.dump({'states': shapes}, f)
  _sync(f'dos_jax.state_to_files:written:{folder}')
  return state_files_tree(opt_state)


def _sync(name: str) -> None:
  """Waits for every process to get here (nothing in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _mesh(state: OffloadedState):
  return None if state.sharded is None else state.sharded.mesh


def _write_state(state: OffloadedState, folder: str, lead: bool) -> None:
  """`state`'s subgroups into `folder`: this process's part of them (all in one
  process). A subgroup in memory split over processes is written by columns, as the
  disk tier's shards are (`shards.json` says how many)."""
  os.makedirs(folder, exist_ok=True)
  part = state.partition
  if part.disk:
    parity = disk_files.parity(state.disk_gen)
    for shard, replicas in disk_files.local_files(part, _mesh(state)).items():
      if replicas[0] == 0:  # the first copy: on one device, of one process
        for g in part.disk:
          disk_files.link_or_copy(disk_files.live_path(part, g, parity, shard),
                                 host_adamw_disk.state_path(folder, g, 0, shard))
  split = {}
  for tier in TIERS:
    blocks = part.blocks(tier)
    for ids, block in zip(blocks, partition_lib.blocks_of(state.tier(tier), len(blocks))):
      if ids and not block[0].is_fully_addressable:
        split.update(dict.fromkeys(map(str, ids), _write_columns(block[0], ids, folder)))
      elif ids:
        rows = np.asarray(jax.device_get(block[0]))
        for j, g in enumerate(ids):
          host_adamw_disk.write_state(folder, g, 0, rows[j])
  if lead:
    with open(os.path.join(folder, 'shards.json'), 'w', encoding='utf-8') as f:
      json.dump({'disk': list(part.disk), 'disk_shards': part.disk_shards,
                 'memory_shards': split}, f)


def _write_columns(rows: jax.Array, ids: tuple[int, ...], folder: str) -> int:
  """The `(R, K, S)` `rows` of subgroups `ids` written by this process's shards (one
  copy of each), as files of their columns; returns how many such files a row has."""
  size = rows.shape[-1]
  count = size // rows.sharding.shard_shape(rows.shape)[-1]
  for shard in rows.addressable_shards:
    if shard.replica_id:
      continue
    data = np.asarray(shard.data)
    start = shard.index[-1].indices(size)[0]
    for j, g in enumerate(ids[shard.index[0]]):
      host_adamw_disk.write_state(folder, g, 0, np.ascontiguousarray(data[j]),
                                  None if count == 1 else start * count // size)
  return count


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
  In a run of several processes each fills only its own devices' files and shards.

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
  split = saved.get('memory_shards', {})

  def read(g, start=0, stop=size):  # columns [start, stop) of the saved subgroup g
    files = saved_shards if g in saved['disk'] else split.get(str(g), 1)
    return disk_files.read_columns(folder, g, k, size, files, start, stop)

  if part.disk:
    parity, width = disk_files.parity(target.disk_gen), size // part.disk_shards
    for shard, replicas in disk_files.local_files(part, _mesh(target)).items():
      for g in part.disk:
        if g in saved['disk'] and saved_shards == part.disk_shards:
          disk_files.link_local(part, g, parity, shard, replicas,
                               host_adamw_disk.state_path(folder, g, 0, shard))
        else:
          start = (shard or 0) * width
          disk_files.write_local(part, g, parity, shard, replicas, read(g, start, start + width))
  tiers = {}
  for tier in TIERS:
    blocks = part.blocks(tier)
    arrays = partition_lib.blocks_of(target.tier(tier), len(blocks))
    tiers[tier] = tuple(_placed(block[0], ids, read) if ids else block[0]
                        for ids, block in zip(blocks, arrays))
  return target.with_tiers(tiers, part)


def _placed(like: jax.Array, ids: tuple[int, ...], read) -> jax.Array:
  """The `(R, K, S)` rows of subgroups `ids` placed as `like`, each process reading only
  its devices' columns (`read(g, start, stop)`)."""
  if like.is_fully_addressable:
    return jax.device_put(np.stack([read(g) for g in ids]).reshape(like.shape), like.sharding)
  size = like.shape[-1]

  def columns(index):
    start, stop, _ = index[-1].indices(size)
    rows = np.stack([read(g, start, stop) for g in ids[index[0]]])
    return rows[(slice(None),) + tuple(index[1:-1])]

  return jax.make_array_from_callback(like.shape, like.sharding, columns)
