"""The disk tier (`dos_jax.Disk`): subgroups whose state lives in files, updated on the host.

Each disk subgroup has two files (`dos_jax.kernels.host_adamw_disk`): the state at the
current generation and the one before. A step reads the current ones and writes the
others, in one native call that reads a subgroup ahead and writes the previous one
behind while it updates the current one, and returns the next generation. The program
carries only that int32 generation (`OffloadedState.disk_gen`): a step that fails midway
leaves the generation, so the state, where it was; `optax.apply_if_finite` keeping the old
state keeps the old generation, whose files the step did not touch.

The disk subgroups are updated after the gradients' clip factor is known (no
speculation), in the one-memory program as they are, in the two-memory program inside a
host region of their own: the host call the device tiers' stream lanes run beside
(`step.program`; on a GPU the kernel is registered in the CUDA plugin,
`kernels.plugin_kernel`). Which files a process holds, and reading and writing them
outside the step: `dos_jax.geometry.disk_files`.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry import slots as slots_lib
from dos_jax.kernels import host_adamw_disk
from dos_jax.geometry import disk_files
from dos_jax.step import kernel_calls
from dos_jax import memory_spaces
from dos_jax.step import paths


def spill_of(disk, slots: slots_lib.Slots, size: int, mesh=None, data_axis: str = 'data'
             ) -> partition_lib.DiskSpill | None:
  """`Offload.disk` as the partition's rule: how many host subgroups' state fits its
  host-memory budget; on a `mesh`, the data shards the state is split over and the
  copies of each on the other axes (each device its own files)."""
  if disk is None:
    return None
  per_subgroup = sum(k * jnp.dtype(g).itemsize for g, k in zip(slots.groups, slots.group_sizes))
  in_memory = None if disk.host_state_bytes is None else disk.host_state_bytes // (
      per_subgroup * size)
  shards = 1 if mesh is None else mesh.shape[data_axis]
  replicas = 1 if mesh is None else mesh.size // shards
  return partition_lib.DiskSpill(disk.directory, in_memory, disk.direct_io, shards, replicas,
                                 None if mesh is None else data_axis)


def check_usable(adamw, layout: layout_lib.Layout, slots: slots_lib.Slots, two_memories: bool,
                 mesh=None, params=None) -> None:
  """Raises a one-line error naming `Offload.disk` when the disk tier cannot hold this
  state: it takes AdamW's fp32 state, with the native kernel built, and params on one
  device or on a mesh with the data axis (`mesh`); the two-memory program where its
  host regions can call the kernel (on a GPU: the CUDA plugin took the handler,
  `kernels.plugin_kernel`)."""
  if adamw is None or kernel_calls.slot_rows(slots, layout.needs_master) is None:
    raise ValueError('Offload.disk holds the state of dos_jax.adamw with fp32 moments '
                     '(mu_dtype=None); this transform has another state')
  spans = {len(s.device_set) for s in map(_sharding, jax.tree.leaves(params)) if s is not None}
  if mesh is None and max(spans, default=1) > 1:
    raise ValueError(f'Offload.disk: the params span {max(spans)} devices on a mesh without '
                     'Offload.data_axis; name the mesh axis the state may split over '
                     '(Offload.data_axis, of size 1 for none)')
  if not host_adamw_disk.disk_kernel_available():
    raise RuntimeError('Offload.disk needs the native disk kernel: '
                       + host_adamw_disk.disk_kernel_unavailable_reason())
  if two_memories:
    ok, why = host_adamw_disk.disk_kernel_in_two_memory_programs()
    if not ok:
      raise ValueError(f'Offload.disk: the GPU plugin cannot run the disk kernel in its host '
                       f'regions ({why}); leave Offload.disk unset (offload.disk_dir: null)')


def _sharding(leaf):
  return getattr(leaf, 'sharding', None) if isinstance(leaf, jax.Array) else None


def write_initial(part: partition_lib.Partition, layout: layout_lib.Layout, params,
                  split_rows) -> jax.Array:
  """Writes each disk subgroup's first state (generation 0), one subgroup at a time,
  from `params` (concrete), its rows made by `split_rows(master rows)` (the state
  builder's) and packed as the layout packs them (shard-major: each device's columns
  hold its own shards, `layout.to_shards`); returns the generation, `int32 0`.

  Each process writes only the files of its own devices (`disk_files.local_files`:
  their data shard's columns, their copy), from its own shards of `params`: no process
  gathers the state, nor the params beyond what its devices' columns need.

  Raises:
    ValueError: this process's shards of a param do not hold what one of its devices'
      columns need (a param split on another axis across processes), naming
      `Offload.disk`.
  """
  os.makedirs(part.disk_dir, exist_ok=True)
  leaves = layout.treedef.flatten_up_to(params)
  local = disk_files.local_files(part, _mesh_of(leaves, part.disk_axis))
  width, dtype = layout.subgroup_size // part.disk_shards, np.dtype(layout.state_dtype)
  views = {(i, shard): _leaf_columns(x, layout, i, shard)
           for shard in local for i, x in enumerate(leaves)}
  for g in part.disk:
    for shard, replicas in local.items():
      cols = np.zeros((1, width if layout.shards > 1 else layout.subgroup_size), dtype)
      for run in partition_lib.pieces_of(layout, (g,)):
        cols[0, run.offset:run.offset + run.size] = views[run.leaf, shard][
            run.start:run.start + run.size]
      if layout.shards == 1 and shard is not None:  # leaf after leaf: the row, cut
        cols = cols[:, shard * width:(shard + 1) * width]
      block, _ = split_rows(jnp.asarray(cols))
      # Half 1, left by an earlier run, goes: generation 0 never reads it, and a run
      # resuming from a checkpoint would otherwise hold three generations at once.
      for replica in replicas:
        disk_files.remove_file(disk_files.live_path(part, g, 1, shard, replica))
      disk_files.write_local(part, g, 0, shard, replicas, np.asarray(block[0])[0])
  return jnp.zeros((), jnp.int32)


def _mesh_of(leaves, axis: str | None):
  """The mesh of the first param placed on one with the data `axis` (None: none)."""
  for leaf in leaves:
    sharding = _sharding(leaf)
    if isinstance(sharding, NamedSharding) and axis in sharding.mesh.shape:
      return sharding.mesh
  return None


def _leaf_columns(leaf, layout: layout_lib.Layout, i: int, shard: int | None) -> np.ndarray:
  """What data shard `shard`'s columns hold of leaf `i`, raveled, from this process's
  shards of it: shard-major its row of `layout.to_shards` (of a leaf split on no
  dimension, read from the rows of its first dimension that hold that row's elements);
  leaf after leaf, the leaf whole (the rows are cut after packing)."""
  shape, n = tuple(layout.shapes[i]), layout.shards
  dim = layout.shard_dims[i] if n > 1 else None
  box, start, stop = [(0, d) for d in shape], 0, math.prod(shape)
  if dim is not None:
    box[dim] = (shard * shape[dim] // n, (shard + 1) * shape[dim] // n)
    stop //= n
  elif n > 1:
    size = layout.shard_sizes[i]
    start, stop = min(shard * size, stop), min((shard + 1) * size, stop)
    if shape:
      inner = math.prod(shape[1:])
      box[0] = (start // inner, -(-stop // inner)) if inner else (0, 0)
      start, stop = start - box[0][0] * inner, stop - box[0][0] * inner
  block = _local_block(leaf, box)
  if block is None:
    raise ValueError(f'Offload.disk: process {jax.process_index()} holds only part of '
                     f'param {i} (shape {shape}) where its devices\' columns of the state '
                     'need it whole; split the params over no other mesh axis across '
                     'processes')
  flat = block.reshape(-1)[start:stop]
  return np.pad(flat, (0, layout.shard_sizes[i] - flat.size)) if n > 1 and dim is None else flat


def _local_block(x, box: list[tuple[int, int]]) -> np.ndarray | None:
  """`x[box]` (`box`: `(start, stop)` per dimension) from this process's shards of `x`,
  or None where they do not hold all of it."""
  if not isinstance(x, jax.Array):
    return np.asarray(x)[tuple(slice(a, b) for a, b in box)]
  out = np.zeros([b - a for a, b in box], x.dtype)
  filled, seen = 0, set()
  for where, data in _shards(x):
    index = tuple(s.indices(d)[:2] for s, d in zip(where, x.shape))
    if index in seen:  # a copy of a shard seen (a sharding's shards never overlap)
      continue
    seen.add(index)
    lo = [max(a, c) for (a, _), (c, _) in zip(box, index)]
    hi = [min(b, d) for (_, b), (_, d) in zip(box, index)]
    if any(l >= h for l, h in zip(lo, hi)):
      continue
    data = np.asarray(data)[tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, index))]
    out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))] = data
    filled += data.size
  return out if filled == out.size else None


def _shards(x: jax.Array) -> list[tuple[tuple[slice, ...], jax.Array]]:
  """`(index, data)` of each of this process's shards of `x`; of a replicated `x`, one
  (jax 0.10 cannot list the shards of a replicated array put across processes)."""
  if x.is_fully_replicated:
    return [((slice(None),) * x.ndim, x.addressable_data(0))]
  return [(shard.index, shard.data) for shard in x.addressable_shards]


def update(context, base_step: paths.RowStep, gen, index=None, subgroups=None, link=None):
  """One step of the disk tier: `(next generation, [(out rows, pieces)])`. `index`:
  inside the sharded construction's `shard_map` (`lanes.sharded_two_streams`, the
  context then the device's own), this device's file (`file_index`). `subgroups`: the
  disk subgroups this call updates (a run of `part.disk`; None: all of them); calls on
  disjoint runs with the same `gen` are independent and return the same next one.
  `link` (`HostWork`'s, or None): the call reads it (an exact zero added to `gen`), so
  that XLA keeps it a host call of its own after the one the link comes from."""
  if index is None and disk_files.file_count(context.part) > 1:  # on a mesh: own files
    assert subgroups is None, 'the jit-partitioned disk tier runs in one call'
    return _update_sharded(context, base_step, gen)
  part, layout = context.part, context.layout
  ids = tuple(part.disk if subgroups is None else subgroups)
  runs = partition_lib.pieces_of(layout, ids)
  rows, size = len(ids), layout.subgroup_size
  grads = partition_lib.slice_pieces(context.grad_leaves, runs)
  params = (None if context.param_leaves is None
            else partition_lib.slice_pieces(context.param_leaves, runs))
  arrays, join = kernel_calls.split_scalars(context.adam_scalars)
  kernel_args = _kernel_args(context, base_step, subgroups=ids)
  if index is not None:
    kernel_args.update(shards=disk_files.file_count(part),
                       num_threads=_threads_per_device(context))
  index = jnp.zeros((), jnp.int32) if index is None else index

  def run(gen, index, grads, params, arrays, link):
    if link is not None:
      gen = gen + link[0].astype(gen.dtype)
    grad_rows = partition_lib.assemble(grads, runs, rows, size, context.grad_dtype)
    param_rows = None if params is None else partition_lib.assemble(
        params, runs, rows, size, jnp.float32)
    return host_adamw_disk.adamw_disk_rows(gen, grad_rows, param_rows, join(arrays),
                                           shard=index, **kernel_args)

  args = (gen, index, grads, params, arrays, link)
  out, new_gen = _in_host_region(run, args, base_step) if part.two_memories else run(*args)
  return new_gen, [(out, runs)]


def _in_host_region(kernel, args, base_step: paths.RowStep):
  """`kernel(*args)` (`(out rows, new generation)`) in a host region of the accelerator
  program, its inputs sent to host memory, its results back to the device through
  `_as_bits`."""
  bits = memory_spaces.put(memory_spaces.host_region(lambda *a: _as_bits(kernel(*a)),
                                     out_spaces=(memory_spaces.HOST, memory_spaces.HOST))(
                                         *memory_spaces.to_host(args)), memory_spaces.DEVICE)
  dtypes = (jnp.dtype(base_step.out_dtype), jnp.dtype(jnp.int32))
  return tuple(jax.lax.bitcast_convert_type(x, d) for x, d in zip(bits, dtypes))


def file_index(part: partition_lib.Partition, axis: str, axis_names) -> jax.Array:
  """Inside `shard_map` over a mesh with `axis_names`, this device's file among
  `disk_files.file_count(part)` (`disk_files.live_path`): its copy on the axes other
  than the data `axis`, then its data shard."""
  others = tuple(a for a in axis_names if a != axis)
  replica = jax.lax.axis_index(others) if others else 0
  return replica * part.disk_shards + jax.lax.axis_index(axis)


def _threads_per_device(context) -> int:
  """Every device of the process runs its call at once: they share the cores."""
  return context.options.host_threads or kernel_calls.threads_per_shard(context.mesh)


def _as_bits(arrays):
  """Each array as unsigned integers of its width: the region's last instructions,
  which carry its scheduling group (XLA gives a host call the frontend attributes of
  the last instruction it wraps, `offloaded_instruction_wrapper.cc`; the kernel's
  custom call carries none), so that in the construction the disk call joins the
  group of the device tiers' stream lanes (`step.program`)."""
  return tuple(jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{8 * x.dtype.itemsize}'))
               for x in arrays)


def _kernel_args(context, base_step: paths.RowStep, subgroups=None, **more) -> dict:
  part = context.part
  return dict(
      directory=part.disk_dir, subgroups=part.disk if subgroups is None else subgroups,
      slots=kernel_calls.slot_rows(base_step.slots, base_step.has_master),
      num_slots=base_step.slots.group_sizes[0], decayed_rows=context.layout.decayed_rows,
      lowp_dtype=base_step.out_dtype, nesterov=context.adamw.nesterov,
      num_threads=context.options.host_threads, direct_io=part.direct_io, **more)


def _update_sharded(context, base_step: paths.RowStep, gen):
  """The disk tier on a mesh: each device's kernel call on its columns of the rows (the
  state split over the data axis: ZeRO-1, and ZeRO-3's shard-major packing) in its own
  files (`disk_files.live_path`: its data shard's, of its copy on the other axes); in
  the two-memory program inside a host region, as the in-memory host tier's
  (`kernel_calls.sharded_host_region_update`). The rows are packed on the device, where XLA
  can move the pieces between devices (`tier_updates.host_rows`)."""
  part, layout, mesh = context.part, context.layout, context.mesh
  axis = context.options.data_axis
  runs = partition_lib.pieces_of(layout, part.disk)
  rows, size, shards = len(part.disk), layout.subgroup_size, layout.shards
  cols = NamedSharding(mesh, P(None, axis))

  def packed(leaves, dtype):
    whole = partition_lib.assemble(partition_lib.slice_pieces(leaves, runs, shards), runs,
                                   rows, size, dtype, shards)
    return jax.lax.with_sharding_constraint(whole, cols)

  grads = packed(context.grad_leaves, context.grad_dtype)
  params = None if context.param_leaves is None else packed(context.param_leaves, jnp.float32)
  arrays, join = kernel_calls.split_scalars(context.adam_scalars)
  kernel_args = _kernel_args(context, base_step, shards=disk_files.file_count(part))
  kernel_args['num_threads'] = _threads_per_device(context)

  def kernel(gen, index, grads, arrays, params):
    return host_adamw_disk.adamw_disk_rows(gen, grads, params, join(arrays), shard=index,
                                           **kernel_args)

  def per_device(gen, grads, arrays, *params):
    args = (gen, file_index(part, axis, mesh.axis_names), grads, arrays,
            params[0] if params else None)
    return _in_host_region(kernel, args, base_step) if part.two_memories else kernel(*args)

  extra = () if params is None else (params,)
  out, new_gen = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(P(), P(None, axis), [P()] * len(arrays)) + (P(None, axis),) * len(extra),
      out_specs=(P(None, axis), P()), check_vma=False,
  )(gen, grads, arrays, *extra)
  return new_gen, [(out, runs)]
