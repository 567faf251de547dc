"""How a step is built: `resolve` decides it once (`Construction`, with the reason for
each choice), and whether the two-memory program's step runs its host and device
halves on two streams (`on_two_streams`; the runner's memory check asks
`stream_regions`)."""

from __future__ import annotations

import dataclasses

from dos_jax import lowering as lowering_lib
from dos_jax.geometry import columns as columns_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.state import OffloadedState


def on_two_streams(part, layout, mesh, asked: bool = True) -> bool:
  """Whether the step runs the host and device halves concurrently by construction
  (`dos_jax.step.lanes`): a two-memory-program state with host subgroups (in memory
  or on disk) and device ones, unsharded or packed shard-major (each device then runs
  the construction on its own columns), unless not `asked`
  (`Implementation.two_streams`)."""
  return bool(asked and part.two_memories
              and (mesh is None or layout.shards > 1)
              and (part.ids(Tier.HOST) or part.disk)
              and (part.ids(Tier.STREAMED) or part.ids(Tier.RESIDENT)))


def step_mesh(sharded):
  """The mesh the step splits the state over: None for an unsharded state, or one on a
  one-device mesh, which splits nothing (the step is built as unsharded, its outputs
  still pinned to the mesh)."""
  return None if sharded is None or sharded.mesh.size == 1 else sharded.mesh


def stream_regions(state: OffloadedState) -> bool:
  """Whether the two-memory program's step of `state` holds its streamed rows in
  stream regions, which XLA keeps live until they are done: what
  `planner.costmodel.streamed_elements_held` needs to count the stream's memory.

  >>> import jax.numpy as jnp, dos_jax
  >>> off = dos_jax.Offload(policy=dos_jax.Stride(2), subgroup_size=4)
  >>> opt = dos_jax.adamw(1e-3, offload=off, implementation=dos_jax.Implementation(program='gpu'))
  >>> state = dos_jax.abstract_state(opt, {'w': jnp.zeros(16)})
  >>> dos_jax.stream_regions(state)
  True
  """
  regions = on_two_streams(state.partition, state.layout, step_mesh(state.sharded))
  return regions and bool(state.partition.ids(Tier.STREAMED))


@dataclasses.dataclass(frozen=True)
class Construction:
  """How one step is built: decided once per step (`resolve`), from the state's
  partition, the step options, the kernels' capability and the jax installed; every
  function that builds the step receives it and decides nothing of its own.

  Attributes:
    two_streams: the host and device halves concurrent by construction (`lanes`).
    lowering: how the stream regions are laid out on this jax (`dos_jax.lowering.Lowering`).
    early: the host tier in early host calls (`early_calls`).
    per_block: the host tier's blocks each a host region of their own
      (`early_calls.host_work`): with early calls, or where the staged lowering spreads
      them over its stages.
    host_native: the host tier's native kernel (else XLA's loop in a host region).
    device_native: the flag the device tiers' paths take (`StepContext.update_blocks`).
    pallas: the Pallas kernel asked for on the device tiers (`UpdateImpl.KERNEL`).
    lanes: the device tiers' stream lanes (`lanes.lane_count`).
    grouped_lanes: how many of them the host call's scheduling group holds.
    sharded: each device runs the construction on its own columns (`shard_map`).
    disk: a disk tier's call joins the host work.
    disk_calls: the host calls the disk tier's update is split into (consecutive runs
      of its subgroups, the same kernel on each): under the staged lowering as many as
      the longest lane has streamed rows (at most one per disk subgroup), so that the
      stages have host work beside each of their rows; else one.
    host_columns: the host regions each host subgroup of the last host call is split
      into, by columns (`columns.split_pieces`: the kernel updates each part's
      elements of the same donated row in place): under the staged lowering as many as
      make a host region beside each streamed row of the longest lane (at most one per
      `COLUMN_ALIGN` elements of a row); else one.
    reasons: one line per choice, why (`explain`).
  """

  two_streams: bool
  lowering: lowering_lib.Lowering
  early: bool
  per_block: bool
  host_native: bool
  device_native: bool
  pallas: bool
  lanes: int
  grouped_lanes: int
  sharded: bool
  disk: bool
  disk_calls: int = 0
  host_columns: int = 1
  reasons: tuple[str, ...] = ()

  def explain(self) -> str:
    """The choices and their reasons, one line each."""
    return '\n'.join(self.reasons)


def resolve(part, layout, mesh, options, native: bool, clipped: bool = False) -> Construction:
  """The construction of a step on a state of partition `part` and `layout` (sharded
  over `mesh`, or None), with `options` (`StepOptions`); `native`: the native host
  kernel can run it (`capability`); `clipped`: the step has a clip factor (its early
  calls speculate, and each early block is redone after the backward pass).

  >>> import jax.numpy as jnp, dos_jax
  >>> from dos_jax.step.options import StepOptions
  >>> off = dos_jax.Offload(policy=dos_jax.Stride(2), subgroup_size=4)
  >>> opt = dos_jax.adamw(1e-3, offload=off, implementation=dos_jax.Implementation(program='gpu'))
  >>> state = dos_jax.abstract_state(opt, {'w': jnp.zeros(16)})
  >>> c = resolve(state.partition, state.layout, None, StepOptions.of(off), native=True)
  >>> c.two_streams, c.lanes, c.early
  (True, 1, True)
  >>> print(c.explain().splitlines()[0])
  two streams: host and device tiers both present, unsharded
  """
  from dos_jax.implementation import UpdateImpl  # pylint: disable=import-outside-toplevel
  from dos_jax.step import lanes as lanes_lib  # pylint: disable=import-outside-toplevel
  reasons = []
  two = on_two_streams(part, layout, mesh, options.two_streams)
  sharded = mesh is not None
  reasons.append(f'two streams: {_why_two_streams(part, layout, mesh, two, options)}')
  host_native = native and options.host is UpdateImpl.KERNEL
  reasons.append('host tier: the native kernel' if host_native else
                 'host tier: XLA in a host region (' +
                 ('asked for, UpdateImpl.XLA' if native else 'the native kernel cannot run it')
                 + ')')
  host_blocks = len(part.blocks(Tier.HOST)) if part.two_memories else 0
  early = bool(part.two_memories and part.early and host_native and host_blocks > 1
               and (not sharded or two))
  reasons.append(f'early host calls: {len(part.early)}' if early else
                 'early host calls: none (' + ('no early calls in the partition' if not
                 part.early else 'needs the native kernel and two host subgroups or more')
                 + ')')
  grouped = options.grouped_lanes()
  streamed = len(part.ids(Tier.STREAMED)) if part.two_memories else 0
  lanes = lanes_lib.lane_count(part.plan, streamed, limit=grouped) if part.two_memories else 0
  lowering = lowering_lib.of_version()
  staged = two and lanes and lowering is lowering_lib.Lowering.STAGED
  longest = -(-streamed // lanes) if lanes else 0
  disk_calls = 1 if part.disk else 0
  if part.disk and staged:
    disk_calls = max(1, min(len(part.disk), longest))
  columns = host_columns(part, layout, longest, early, disk_calls, clipped) if (
      staged and host_native and host_blocks) else 1
  per_block = early or (two and host_native and lowering is lowering_lib.Lowering.STAGED
                        and (host_blocks > 1 or columns > 1))
  if two:
    reasons.append(f'stream lanes: {lanes} (the group holds {grouped} beside the host call '
                   'under the limit the step is compiled with)')
    reasons.append(f'lowering: {lowering.value} (jax {".".join(map(str, _version()))})')
  if columns > 1:
    reasons.append(f'host columns: {columns} host regions per host subgroup of the last '
                   f'call, a host region beside each of the {longest} streamed rows of the '
                   'longest lane')
  return Construction(
      two_streams=two, lowering=lowering, early=early, per_block=per_block,
      host_native=host_native,
      device_native=native and options.device is UpdateImpl.KERNEL,
      pallas=options.device is UpdateImpl.KERNEL, lanes=lanes,
      grouped_lanes=min(lanes, grouped), sharded=sharded, disk=bool(part.disk),
      disk_calls=disk_calls, host_columns=columns, reasons=tuple(reasons))


def host_columns(part, layout, longest: int, early: bool, disk_calls: int,
                 clipped: bool) -> int:
  """The column regions per host subgroup of the last host call that make a host region
  beside each of a lane's `longest` streamed rows, the other regions after the backward
  pass counted (the early blocks' redo calls where `clipped`, the disk tier's
  `disk_calls`) (`Construction.host_columns`; at most one per `columns.COLUMN_ALIGN`
  elements). With the regions in column-major order (`early_calls.host_work`) a stage
  then holds at most one region of each host subgroup: XLA cannot keep a chain of host
  calls in one scheduling group (a group "with gaps"), and a subgroup's column regions
  run one after another, each reading the state the one before wrote."""
  blocks = len(part.blocks(Tier.HOST))
  calls = partition_lib.host_calls(range(blocks), part.early if early else ())
  redone = sum(len(c) for c in calls[:-1]) if clipped and len(calls) > 1 else 0
  most = max(1, layout.shard_size // columns_lib.COLUMN_ALIGN)
  return max(1, min(most, -(-(longest - disk_calls - redone) // len(calls[-1]))))


def _why_two_streams(part, layout, mesh, two: bool, options) -> str:
  if two:
    return 'host and device tiers both present, ' + (
        'unsharded' if mesh is None else 'each device on its own columns (shard-major)')
  if not options.two_streams:
    return 'no (asked for, Implementation(two_streams=False))'
  if not part.two_memories:
    return 'no (the one-memory program)'
  if mesh is not None and layout.shards <= 1:
    return 'no (a sharded state not packed shard-major)'
  if not (part.ids(Tier.HOST) or part.disk):
    return 'no (no host tier)'
  return 'no (no device tier)'


def _version() -> tuple[int, ...]:
  import jax  # pylint: disable=import-outside-toplevel
  return tuple(jax.__version_info__[:3])
