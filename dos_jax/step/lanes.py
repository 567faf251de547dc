"""The device tiers in stream lanes, beside the host tier: the two-memory program's
host and device updates concurrent by construction (docs/design.md, rules 1 and 3).

* `update_on_two_streams` -- the host tier in host regions and the device tiers
  (streamed, resident) in stream regions, one per lane, as many lanes as the
  compile's limit allows in one scheduling group with the host call
  (`construction.Construction.grouped_lanes`);
* `stream_lanes`, `lane_count` -- which blocks each lane runs: the streamed rows
  round-robin in stream order, so consecutive rows sit on different CUDA streams (XLA
  runs a region's copies one after another);
* `sharded_two_streams` -- a state packed shard-major: the same on each device's own
  columns, inside `shard_map`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from dos_jax import lowering as lowering_lib
from dos_jax import meshes
from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.partition import Tier
from dos_jax.step import device_stream
from dos_jax.step import kernel_calls
from dos_jax.step import paths
from dos_jax.step import host_work as host_work_lib
from dos_jax.step import stages
from dos_jax.step import tier_updates


# The most stream lanes a step runs in unless told (`lane_count`). Two lanes put a
# row's write-back and the next row's fetch on two CUDA streams (full duplex); more
# would not compile under the latency-hiding scheduler alone: XLA's default limit lets
# 2 asynchronous calls be in flight, and with two ungrouped lanes in flight across the
# host call's group the compile stops ("There is a scheduling group which exceeds the
# overlap limits ... needs 1 kGpuAsyncStreamComputes resources, but the limit is 0";
# Stride(2, buffers=3), 8 x 1024, XLA 0.11.2).
MAX_LANES = 2


def lane_count(plan, streamed_rows: int, lanes: int = 0, limit: int | None = None) -> int:
  """How many stream lanes the device tiers run in: `lanes` (0: the plan's `buffers`,
  at most `MAX_LANES`), at most one per streamed row and at most `limit` (the lanes the
  host call's scheduling group may hold, `StepOptions.grouped_lanes`; None: no limit),
  one at least."""
  count = lanes or min(plan.buffers, MAX_LANES)
  if limit is not None:
    count = min(count, limit)
  return max(1, min(count, streamed_rows))


def update_on_two_streams(context: tier_updates.StepContext, base_step: paths.RowStep,
                           tiers: dict[Tier, tuple], built,
                           host_work: host_work_lib.HostWork | None = None,
                           barrier: bool = False, sharded_host=None, sharded_disk=None):
  """The two-memory program's tiers, host and device halves concurrent by construction,
  as `built` (`construction.Construction`) says: the host tier in host regions and the
  device tiers (streamed, resident) in stream regions, one per lane (`stream_lanes`),
  each on a GPU stream of its own, laid out as this jax's XLA accepts (`built.lowering`):
  in one scheduling group with the last host call (`IN_REGION`), or stage by stage, each
  stage's regions with a host call of their own (`STAGED`, `dos_jax.step.stages`).
  Returns (new tiers, `(out rows, their pieces)` per block), as the tier-by-tier loop
  does. `host_work`, if given, is the host tier's `HostWork` (early calls, a disk call);
  by default the host tier in one call. A state sharded shard-major runs the same on
  each device's columns (`sharded_two_streams`, `sharded_host` making each device's
  `host_work` and `sharded_disk` its disk call; `barrier`: each region's results
  through an optimization barrier, which that needs).

  Each lane's rows are one stream region whose first `built.grouped_lanes` lanes join
  the host call's scheduling group, all named as its lanes. A row's state enters a
  lane only once the lane's previous row is back in host memory: the region runs its
  copies one after another anyway, and XLA then counts one copy in flight for it (one
  lane holding two rows in flight does not compile under the scheduler alone).
  `barrier`: each region's results through an optimization barrier (inside
  `shard_map`, read piecewise, they would each become a stream call of their own)."""
  if context.mesh is not None:
    return sharded_two_streams(context, base_step, tiers, built, sharded_host, sharded_disk)
  if host_work is None:
    host_work = host_work_lib.of_tier(context, base_step, tiers[Tier.HOST], built.host_native)
  part = context.part
  lanes = stream_lanes(context.plan, part, count=built.lanes)
  if built.lowering is lowering_lib.Lowering.STAGED:
    return stages.update(context, base_step, tiers, host_work, lanes,
                         native=built.device_native, pallas=built.pallas, barrier=barrier)
  group = device_stream.next_group()
  # The host regions: the ungrouped ones, then the last host call's, in the group (as
  # `HostWork.run_grouped`, traced here so that each kernel call sits right below).
  for item in host_work.ungrouped:
    item.record(item.region(link=host_work.link, **item.inputs()))
  with device_stream.in_group(group):
    for item in host_work.items:
      item.record(item.region(link=host_work.link, **item.inputs()))
  host, outs = host_work.finish()
  given = {t: partition_lib.blocks_of(tiers[t], len(part.blocks(t)))
           for t in (Tier.STREAMED, Tier.RESIDENT) if part.ids(t)}
  new_blocks = {t: [None] * len(blocks) for t, blocks in given.items()}
  rows_out = []
  for lane, work in enumerate(lanes):
    args = (context.grad_leaves, [[given[tier][b] for b in indices] for tier, indices in work])
    lane_update = functools.partial(context.update_lane, base_step=base_step, work=work,
                                    native=built.device_native)
    closed, out_shape = jax.make_jaxpr(lane_update, return_shape=True)(*args)
    new, rows = device_stream.bind(
        closed, out_shape, args, group if lane < built.grouped_lanes else None,
        stream=device_stream.STREAM + lane, lanes=group)
    if barrier:
      new, rows = jax.lax.optimization_barrier((new, rows))
    for (tier, indices), tier_new, tier_rows in zip(work, new, rows):
      for b, arrays, out in zip(indices, tier_new, tier_rows):
        new_blocks[tier][b] = tuple(arrays)
        rows_out.append(((tier, b), out))
  return stages.joined(context, tiers, host, outs, new_blocks, rows_out)


def sharded_two_streams(context: tier_updates.StepContext, base_step: paths.RowStep,
                         tiers: dict[Tier, tuple], built, host=None, disk=None):
  """`update_on_two_streams` on each device's own columns, inside `shard_map`: a state
  packed shard-major holds, on device d, exactly the rows one shard's layout packs
  (`layout_lib.local`), so each device runs the unsharded construction on its shards;
  `host(local context, step, local host tier)`, if given, makes its `host_work` maker
  (the early calls); `disk` (`program._ShardedDisk`), if given, runs each device's disk
  call after its other host work (`disk.compose`) and takes the new generation
  (`disk.done`).
  Jit's partitioning would split a stream region into several calls
  (tests/test_compiled_sharded_region.py)."""
  mesh, axis = context.mesh, context.options.data_axis
  rows_spec, view_spec, whole = P(None, None, axis), P(axis, None), P()
  local_layout = layout_lib.local(context.layout)
  names = [t for t in TIERS if tiers[t]]
  adam_arrays, adam_join = ((), lambda arrays: None) if context.adam_scalars is None \
      else kernel_calls.split_scalars(context.adam_scalars)
  pieces = []

  def body(grad_views, param_views, arrays, scalars, new_scalars, adam_arrays, coefficients,
           grad_scale, *gen):
    # Each host-bound gradient piece leaves for host memory as the backward pass makes
    # it, outside the scheduling group (rule 2), as in the unsharded step; early calls
    # send each block's pieces themselves, ungated, so that a chunk waits for its own.
    views = [v.reshape(-1) for v in grad_views]
    host_grad_pieces, grads = ({}, views) if host is not None else \
        tier_updates.gate_device_update(local_layout, context.part, views)
    local = dataclasses.replace(
        context, layout=local_layout, mesh=None, host_grad_pieces=host_grad_pieces,
        host_inputs=[], grad_leaves=list(grads),
        param_leaves=None if param_views is None else [v.reshape(-1) for v in param_views],
        scalars=tuple(scalars), new_scalars=tuple(new_scalars),
        adam_scalars=adam_join(adam_arrays), coefficients=coefficients)
    step = dataclasses.replace(base_step, grad_scale=grad_scale[0] if grad_scale else None)
    local_tiers = {t: () for t in TIERS}
    local_tiers.update(zip(names, arrays))
    host_work = None if host is None else host(local, step, local_tiers[Tier.HOST])
    disk_update = None
    if disk is not None:
      host_work, disk_update = disk.compose(local, step, host_work,
                                              local_tiers[Tier.HOST], gen[0], mesh.axis_names)
    new_tiers, outs = update_on_two_streams(local, step, local_tiers, built, host_work,
                                             barrier=True)
    if disk_update is not None:
      outs, gen = list(outs) + disk_update.outs, (disk_update.gen,)
    pieces[:] = [runs for _, runs in outs]
    return ([new_tiers[t] for t in names], [o for o, _ in outs]) + gen

  param_views = context.param_leaves
  grad_scale = () if base_step.grad_scale is None else (base_step.grad_scale,)
  args = (list(context.grad_leaves), None if param_views is None else list(param_views),
          [tiers[t] for t in names], tuple(context.scalars), tuple(context.new_scalars),
          adam_arrays, context.coefficients, grad_scale) + (() if disk is None else (disk.gen,))
  in_specs = (view_spec, None if param_views is None else view_spec, rows_spec, whole,
              whole, whole, whole, whole) + (() if disk is None else (whole,))
  mesh = meshes.as_traced(mesh)
  # The kernels and regions have no replication rule for the checker.
  new, outs, *gen = jax.shard_map(
      body, mesh=mesh, in_specs=in_specs,
      out_specs=(rows_spec, P(None, axis)) + (() if disk is None else (whole,)),
      check_vma=False)(*args)
  if disk is not None:
    disk.done(gen[0])
  new_tiers = dict(tiers)
  new_tiers.update(zip(names, (tuple(x) for x in new)))
  return new_tiers, list(zip(outs, pieces))


def stream_lanes(plan, part: partition_lib.Partition,
                 count: int = 0) -> list[list[tuple[Tier, list[int]]]]:
  """The device tiers' blocks as lanes, one stream region each: `[(tier, block
  indices)]` per lane. The streamed blocks go round-robin in stream order over
  `lane_count` lanes (`count`; 0: `buffers`, at most `MAX_LANES`), so
  consecutive rows of the stream sit on different CUDA streams; the resident tier joins
  the last lane."""
  lanes: list[list[tuple[Tier, list[int]]]] = []
  if part.ids(Tier.STREAMED):
    order = partition_lib.stream_order(part, plan.streamed)
    used = lane_count(plan, len(order), count)
    lanes = [[(Tier.STREAMED, order[k::used])] for k in range(used)]
  if part.ids(Tier.RESIDENT):
    resident = (Tier.RESIDENT, list(range(len(part.blocks(Tier.RESIDENT)))))
    if lanes:
      lanes[-1].append(resident)
    else:
      lanes.append([resident])
  return lanes
