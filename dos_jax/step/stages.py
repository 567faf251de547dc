"""The device tiers' stream lanes stage by stage (`dos_jax.lowering.Lowering.STAGED`).

On jax 0.12 XLA runs a stream region on its parallel execution thread, where an
optimization barrier is not lowered and constants are not emitted, and it keeps a
scheduling group only for asynchronous calls linked by no other instruction
(`legalize_scheduling_annotations.cc`: a group "with gaps" is refused). So one region
cannot gate its rows' fetches, and two chained regions cannot share a group. Instead
the step runs in stages (docs/design.md, "The staged lowering"):

* stage s holds one streamed row per lane, each lane's row in a region of its own
  (fetch, the Pallas kernel, write-back: nothing else), and a host call of its own
  (some of the host regions left after the early calls), all in one scheduling group:
  every device update of the stage runs inside that host call's window;
* a lane's region of stage s+1 takes its state through an optimization barrier (outside
  the regions) with the lane's new state of stage s: its fetch waits for stage s's
  write-back of the same lane only, so the streamed tier holds at most one row per lane
  (and one arriving) in device memory;
* the host call of stage s+1 is linked after stage s's (`early_calls.link_after`), so
  XLA keeps them apart;
* what each region reads besides the state (gradient row, kernel coefficients, decay
  limit) is computed on the main thread and passes an optimization barrier, so XLA
  cannot fold a constant into the region.

The host regions are as many as the longest lane has rows where the native kernel runs
the host tier (`Construction.host_columns` splits its subgroups by columns). Rows
beyond the host regions even so run in regions of their own after the last stage,
outside every host call: there is no host work left to run beside them. The resident
tier joins the last stage's last lane.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax import capability as capability_lib
from dos_jax import compiler_options
from dos_jax import memory_spaces
from dos_jax.capability import Kernel
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import Tier
from dos_jax.step import device_stream
from dos_jax.step import early_calls
from dos_jax.step import kernel_calls
from dos_jax.step import paths
from dos_jax.step.host_work import HostWork


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which rows each stage runs: `grouped[s][lane]` the `(tier, block)` rows of lane
  `lane` in stage s (grouped with host regions `items[s]`, indices into the work's
  items); `after[lane]` the rows each run alone after the last stage."""

  grouped: tuple[tuple[tuple[tuple[Tier, int], ...], ...], ...]
  items: tuple[tuple[int, ...], ...]
  after: tuple[tuple[tuple[Tier, int], ...], ...]


def layout(lanes, num_items: int) -> Layout:
  """The stages of `lanes` (`lanes.stream_lanes`: `[(tier, block indices)]` per lane)
  beside `num_items` host regions: one streamed row per lane and stage, as many stages
  as the longest lane has rows and host regions allow (one at least), the host regions
  split over them in order; the resident rows in the last stage's last lane.

  >>> lay = layout([[(Tier.STREAMED, [0, 2])], [(Tier.STREAMED, [1])]], num_items=3)
  >>> [[[b for _, b in lane] for lane in stage] for stage in lay.grouped], lay.items
  ([[[0], [1]], [[2], []]], ((0, 1), (2,)))
  """
  streamed = [[(t, b) for t, blocks in lane if t is Tier.STREAMED for b in blocks]
              for lane in lanes]
  resident = [(t, b) for lane in lanes for t, blocks in lane if t is Tier.RESIDENT
              for b in blocks]
  longest = max((len(rows) for rows in streamed), default=0)
  stages = max(1, min(longest, num_items))
  grouped = [[tuple(rows[s:s + 1]) for rows in streamed] for s in range(stages)]
  if not grouped[0]:
    grouped = [[()]]
  last = grouped[-1]
  last[-1] = last[-1] + tuple(resident)
  items = tuple(tuple(int(i) for i in part) for part in
                np.array_split(np.arange(num_items), stages))
  after = tuple(tuple(rows[stages:]) for rows in streamed) or ((),)
  return Layout(grouped=tuple(tuple(stage) for stage in grouped), items=items, after=after)


def update(context, base_step: paths.RowStep, tiers: dict[Tier, tuple], work: HostWork,
           lanes, *, native: bool, pallas: bool, barrier: bool = False):
  """The staged construction of one step: `(new tiers, (out rows, pieces) per block)`.
  `work` the host regions to run beside the device tiers, `lanes` the device tiers'
  lanes, `native` the flag the device tiers' paths take (`StepContext.update_blocks`),
  `pallas`: the Pallas kernel asked for (else, or where it cannot run, XLA's update,
  outside any stream region); `barrier`: each region's results through an
  optimization barrier (inside `shard_map`)."""
  part = context.part
  given = {t: partition_lib.blocks_of(tiers[t], len(part.blocks(t)))
           for t in (Tier.STREAMED, Tier.RESIDENT) if part.ids(t)}
  items = work.every_item()
  lay = layout(lanes, len(items))
  surplus = sum(len(rows) for rows in lay.after)
  if surplus and jax.default_backend() == 'gpu':
    compiler_options.warn_rows_beside_no_host_work(
        surplus, len(items), len(lay.grouped) + max(len(rows) for rows in lay.after))
  kernel = _Kernel.of(context, base_step) if pallas else None
  new_blocks = {t: [None] * len(blocks) for t, blocks in given.items()}
  rows_out, last_state, link = [], {}, work.link

  def run(rows, lane: int, group: int | None):
    blocks_in = [given[t][b] for t, b in rows]
    if lane in last_state:  # this lane's previous rows are back in host memory first
      blocks_in, _ = jax.lax.optimization_barrier((blocks_in, last_state[lane]))
    if kernel is None:
      new, outs = _xla_rows(context, base_step, rows, blocks_in, native)
    else:
      new, outs = kernel.in_region(rows, blocks_in, group, lane)
    if barrier:
      new, outs = jax.lax.optimization_barrier((new, outs))
    last_state[lane] = new
    for (tier, b), arrays, out in zip(rows, new, outs):
      new_blocks[tier][b] = tuple(arrays)
      rows_out.append(((tier, b), out))

  for index, (stage, indices) in enumerate(zip(lay.grouped, lay.items)):
    group = device_stream.next_group()
    with device_stream.in_group(group), device_stream.late_call(index):
      # Each item as `host_work.run` traces it, here so that each kernel call sits
      # right below.
      tokens = [items[i].record(items[i].region(link=link, **items[i].inputs()))
                for i in indices]
    for lane, rows in enumerate(stage):
      if rows:
        run(rows, lane, group)
    tokens = [t for t in tokens if t is not None]
    if tokens:
      link = early_calls.link_after(tokens)
  for lane, rows in enumerate(lay.after):
    for row in rows:
      run((row,), lane, None)
  host, outs = work.finish()
  return joined(context, tiers, host, outs, new_blocks, rows_out)


def joined(context, tiers, host, host_outs, new_blocks, rows_out):
  """`(new tiers, (out rows, pieces) per block)` from the host tier's new arrays and out
  rows and the device tiers' `new_blocks` ({tier: blocks}) and `rows_out`
  ([((tier, block), out rows)]): what both lowerings return."""
  new_tiers = dict(tiers)
  new_tiers[Tier.HOST] = host
  new_tiers.update({t: tuple(x for block in blocks for x in block)
                    for t, blocks in new_blocks.items()})
  pieces = lambda tier, b: partition_lib.pieces_of(context.layout, context.part.blocks(tier)[b])
  return new_tiers, list(host_outs) + [(out, pieces(tier, b)) for (tier, b), out in rows_out]


def _xla_rows(context, base_step, rows, blocks_in, native: bool):
  """Rows updated by XLA's ops, on the compute stream (no region: XLA's update holds
  constants, which a stream region cannot emit on jax 0.12)."""
  new, outs = [], []
  for (tier, b), arrays in zip(rows, blocks_in):
    tier_new, tier_outs = context.update_blocks(tier, base_step, {b: arrays}, native,
                                                in_flight=1)
    new.append(tier_new[b])
    outs.append(tier_outs[b][0])
  return new, outs


@dataclasses.dataclass(frozen=True)
class _Kernel:
  """The Pallas AdamW of the stages' regions, its inputs made outside them."""

  context: object
  base_step: paths.RowStep

  @classmethod
  def of(cls, context, base_step) -> '_Kernel | None':
    usable = capability_lib.capability(Kernel.PALLAS, context.adamw, base_step,
                                       context.program).usable
    return cls(context, base_step) if usable and context.coefficients is not None else None

  def in_region(self, rows, blocks_in, group: int | None, lane: int):
    """`rows` of one lane and stage in one stream region: (new block arrays, out
    rows) per row."""
    from dos_jax.kernels import pallas_adamw  # pylint: disable=import-outside-toplevel
    context, step = self.context, self.base_step
    inputs = [self._row_inputs(tier, b, arrays) for (tier, b), arrays in zip(rows, blocks_in)]
    packed = context.coefficients  # made once per step, outside every region
    # The decay limits are constants: through a barrier, XLA cannot fold them in. (The
    # coefficients derive from the step count.)
    limits = jax.lax.optimization_barrier([limit for _, _, limit in inputs])
    inputs = [(grad, param, limit) for (grad, param, _), limit in zip(inputs, limits)]
    tiers = [tier for tier, _ in rows]
    slots = kernel_calls.slot_rows(step.slots, step.has_master)
    lowp = step.out_dtype if step.has_master else None
    nesterov = context.adamw.nesterov

    def region(packed, inputs, blocks_in):
      new, outs = [], []
      for tier, (grad, param, limit), arrays in zip(tiers, inputs, blocks_in):
        block = arrays[0][0]
        if tier is Tier.STREAMED:
          block = memory_spaces.put(block, memory_spaces.DEVICE)

        kernel = functools.partial(pallas_adamw.adamw_pallas_rows_packed, packed, limit,
                                   slots=slots, lowp_dtype=lowp, nesterov=nesterov)
        new_block, new_master, lowp_row = jax.lax.platform_dependent(
            block, grad, param, cpu=functools.partial(kernel, interpret=True),
            default=functools.partial(kernel, interpret=False))
        out = lowp_row if step.has_master else (new_master - param).astype(step.out_dtype)
        if tier is Tier.STREAMED:
          new_block = memory_spaces.put(new_block, memory_spaces.HOST)
        new.append((new_block[None],))
        outs.append(out[None])
      return new, outs

    args = (packed, inputs, blocks_in)
    closed, out_shape = jax.make_jaxpr(region, return_shape=True)(*args)
    return device_stream.bind(closed, out_shape, args, group,
                              stream=device_stream.STREAM + lane, lanes=group)

  def _row_inputs(self, tier: Tier, b: int, arrays):
    """A one-row block's gradient row, param row (None: the state has a master) and
    decay limit, in device memory."""
    context = self.context
    ids = context.part.blocks(tier)[b]
    step = context.block_step(self.base_step, ids)
    grads, params = context.device_rows(step, arrays,
                                        partition_lib.pieces_of(context.layout, ids))
    size = arrays[0].shape[-1]
    limit = jnp.full((1,), size if step.decayed_rows > 0 else 0, jnp.int32)
    return grads[0], None if params is None else params[0], limit
