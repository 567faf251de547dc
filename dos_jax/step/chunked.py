"""The accelerator program's step in K linked chunks: host and device updates concurrent.

With per-subgroup storage, the host subgroups are updated in K host calls, the last
subgroups first (the backward pass makes their gradients first), and the streamed
subgroups in K device parts, in the plan's stream order. Chunk k is tied to chunk k-1 by
data only:

* host chunk k's native call reads the *link* of chunk k-1 (a `(1,)` float32 zero in
  host memory, added to its row indices), so every instruction of its region depends on
  it and XLA keeps the region its own host call (`tests/test_compiled_host_chunks.py`);
* device part k is let through an optimization barrier with exactly host chunk k's
  inputs (its gradient pieces in host memory, its scalars, the link), so it cannot be
  issued before host call k can start (on the device tiers' stream, its scheduling
  group does that);
* the link of chunk k is computed *on the device* from a token of host chunk k's out
  rows (returned in device memory) and one of device part k's out rows: host chunk k+1
  and device part k+1 come after both halves of chunk k.

What this forces, whatever the schedule: chunk k's host call and device part both lie
between the end of chunk k-1 and the start of chunk k+1, so no device part can drift to
another chunk's call (or after the last one) and no host call waits for all device work.
Inside a chunk, with `Offload.device_stream` (and a jax that builds it), the device part
is one call per stream lane (the chunk's rows whose stream position is k mod lanes,
each on a stream of its own) in one scheduling group with host call k
(`dos_jax.step.device_stream`): the windows overlap in every schedule. Without it, whether
the device part is issued between the host call's start and done is the latency-hiding
scheduler's choice (it fills the call's estimated latency with ready work before it
places the start; experiments/RESULTS.md).

The link is exactly zero (`where(isfinite(t), t, 0) * 0`): the host kernel's row
indices, and so its results, are the unchunked step's bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dos_jax.step import device_stream
from dos_jax.step import fused as fused_lib
from dos_jax.step import lanes as lanes_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.step import paths
from dos_jax.geometry.partition import Tier


def host_blocks(part: partition_lib.Partition, decayed_rows: int | None = None) -> list[int]:
  """The host blocks (one per subgroup) in the order their host calls run: the last
  subgroups first, whose gradients the backward pass makes first. Given the layout's
  `decayed_rows`, the blocks past them come last: they hold the leaves without weight
  decay (the norm scales of every layer), whose gradients are complete only when the
  backward pass reaches the first layer (and, split over a mesh, once their combined
  reduction is done).

  >>> import dos_jax
  >>> from dos_jax.geometry import partition
  >>> part = partition.for_plan(dos_jax.Plan(streamed=(0, 2, 4), host=(1, 3, 5)),
  ...                           split=True, per_subgroup=True)
  >>> [part.blocks(partition.Tier.HOST)[b] for b in host_blocks(part, decayed_rows=5)]
  [(3,), (1,), (5,)]
  """
  blocks = part.blocks(Tier.HOST)
  order = list(range(len(blocks)))[::-1]
  if decayed_rows is None:
    return order
  late = [b for b in order if min(blocks[b]) >= decayed_rows]
  return [b for b in order if b not in late] + late


def stream_blocks(part: partition_lib.Partition, plan) -> list[int]:
  """The streamed blocks (one per subgroup) in the plan's stream order."""
  return partition_lib.stream_order(part, plan.streamed)


def chunk_count(part: partition_lib.Partition, plan, chunks: int) -> int:
  """How many chunks a step runs: at most `chunks`, each with a host and a streamed
  subgroup at least."""
  return max(1, min(chunks, len(part.ids(Tier.HOST)), len(plan.streamed)))


def zero_of(x: jax.Array) -> jax.Array:
  """An exact float32 zero computed from `x` (finite or not)."""
  x = x.reshape(-1)[:1].astype(jnp.float32)
  return jnp.where(jnp.isfinite(x), x, 0) * 0


def update(context, base_step: paths.RowStep, tiers: dict[Tier, tuple], chunks: int):
  """The host and streamed tiers of a per-subgroup state in `chunks` linked chunks (see
  the module docstring); returns (their new arrays by tier, `(out rows on the device,
  pieces)` per block).

  `context` is the step's `tier_updates.StepContext`; the host tier takes the native
  kernel (unsharded), the streamed tier its device path.
  """
  part, layout, plan = context.part, context.layout, context.plan
  count = chunk_count(part, plan, chunks)
  blocks = {t: part.blocks(t) for t in (Tier.HOST, Tier.STREAMED)}
  new = {t: list(partition_lib.blocks_of(tiers[t], len(blocks[t]))) for t in blocks}
  hosts, streams = host_blocks(part, layout.decayed_rows), stream_blocks(part, plan)
  outs, link, done = [], None, []
  on_stream = context.offload.device_stream and device_stream.available()

  for host_chunk, stream_chunk in zip(np.array_split(hosts, count),
                                      np.array_split(streams, count)):
    inputs, tokens = [], []
    group = device_stream.next_group() if on_stream else None
    with device_stream.in_group(group) if on_stream else contextlib.nullcontext():
      for b in host_chunk:
        ids = blocks[Tier.HOST][b]
        runs = partition_lib.pieces_of(layout, ids)
        grad_pieces, param_pieces = context.host_pieces(runs)
        arrays, out, token = fused_lib.host_region_update(
            context.block_step(base_step, ids), context.fused, stacked=new[Tier.HOST][b],
            adam_scalars=context.adam_scalars, grad_pieces=grad_pieces,
            param_pieces=param_pieces, runs=runs, num_threads=context.offload.host_threads,
            inputs_sink=inputs, link=link)
        new[Tier.HOST][b] = paths.put(arrays, paths.HOST)
        outs.append((out, runs))
        tokens.append(token)
    # The device part waits for exactly what host call k needs (see the module docstring);
    # on its stream, grouped with host call k, it needs no gate.
    leaves = list(context.grad_leaves)
    if not on_stream:
      _, leaves = lax.optimization_barrier((inputs, leaves))
    position = {b: p for p, b in enumerate(streams)}
    lanes = lanes_lib.lane_count(plan, len(streams), context.offload.stream_lanes) \
        if on_stream else 1
    for lane in range(lanes):
      lane_blocks = [b for b in stream_chunk if position[b] % lanes == lane]
      if not lane_blocks:
        continue
      # In flight: `buffers` rows on one stream, one row per lane on `lanes` streams.
      in_flight = plan.buffers if lanes == 1 else 1
      lane_done = [b for b in done if position[b] % lanes == lane]
      earlier = {b: new[Tier.STREAMED][b] for b in lane_done[-in_flight:]}

      def device_part(leaves, chunk_blocks, earlier, lane_blocks=lane_blocks,
                      lane_done=lane_done, in_flight=in_flight):
        gated = dataclasses.replace(context, grad_leaves=list(leaves))
        fresh, order, rows = dict(earlier), list(lane_done), []
        for b, block in zip(lane_blocks, chunk_blocks):
          ids = blocks[Tier.STREAMED][b]
          if len(order) >= in_flight:  # rows in flight bounded, as unchunked
            block, _ = lax.optimization_barrier((block, fresh[order[-in_flight]]))
          runs = partition_lib.pieces_of(layout, ids)
          fresh[b], out = gated.streamed(context.block_step(base_step, ids), block, ids, runs)
          rows.append((fresh[b], out))
          order.append(b)
        return rows

      if on_stream:  # the device part on its lane's stream, grouped with host call k
        device_part = device_stream.on_stream(device_part, group,
                                              stream=device_stream.STREAM + lane)
      rows = device_part(leaves, [new[Tier.STREAMED][b] for b in lane_blocks], earlier)
      for b, (block, out) in zip(lane_blocks, rows):
        new[Tier.STREAMED][b] = tuple(block)
        outs.append((out, partition_lib.pieces_of(layout, blocks[Tier.STREAMED][b])))
        tokens.append(out)
    done.extend(stream_chunk)
    link = paths.to_host(sum(zero_of(t) for t in tokens))
  return {t: tuple(x for block in new[t] for x in block) for t in new}, outs
