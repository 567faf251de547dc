"""Which subgroups are stored in which tier of the optimizer state, and where each
leaf's elements fall inside a tier.

The two-memory program keeps the state of the host-updated and of the device-streamed
subgroups in separate arrays (see `Tier`). Both paths of one step then read and write
only their own array: no value flows from one to the other, and XLA is free to run the
host region and the device stream at the same time. Within a tier, rows are stored in
ascending subgroup order, so the weight-decayed subgroups (the layout packs them first)
are the tier's leading rows and "decayed" stays one threshold per tier.

A tier is stored in *blocks*, each one `(R_b, K, S)` array per dtype (see `slots`). The
two-memory program keeps one block per subgroup: a plan change then moves only the rows
that change tier, and a row that stays keeps its buffer (see `migration`). The
one-memory program keeps its state as one array (one block).

`Piece`s describe a leaf's elements per tier: a contiguous run of a leaf that lands in
consecutive elements of a tier's rows. Gradients leave the device piece by piece (a
piece of a leaf needs only that leaf, never a concatenation of all gradients), and the
new parameters are reassembled piece by piece from the tiers' output rows.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry.layout import Layout
from dos_jax.policies import Plan


class Tier(enum.Enum):
  """Where a subgroup's state is stored and updated.

  HOST: pinned host memory, updated there (the host path).
  STREAMED: pinned host memory, copied to the device, updated there and copied back.
  RESIDENT: device memory, updated there (the `AllDevice` baseline).
  DISK: files on disk (`dos_jax.Disk`), updated on the host as they stream through
    memory; the state holds no array of them (not in `TIERS`).
  """

  HOST = 'host'
  STREAMED = 'streamed'
  RESIDENT = 'resident'
  DISK = 'disk'

  @property
  def memory_kind(self) -> str:
    """The memory kind its arrays live in: 'device' (resident) or 'pinned_host'."""
    return 'device' if self is Tier.RESIDENT else 'pinned_host'

  def __lt__(self, other: 'Tier') -> bool:
    # Ordered, so that dicts keyed by tier are pytrees (JAX sorts dict keys).
    return self.value < other.value


TIERS = (Tier.HOST, Tier.STREAMED, Tier.RESIDENT)


@dataclasses.dataclass(frozen=True)
class Partition:
  """The subgroups of each tier, ascending, every subgroup in exactly one tier, and how
  the two-memory program's step runs them: static metadata of the state (array shapes
  depend on it), hashable, so that the step depends on the state alone.

  Attributes:
    host, streamed, resident: the subgroups of each tier (see `Tier`), ascending.
    two_memories: the two-memory program's partition (see `for_plan`): every subgroup is
      its own block. Otherwise the one-memory program's single array.
    stream: the streamed subgroups in the order the stream reaches them (the plan's).
    buffers: streamed rows in flight at once: the step's stream lanes.
    early: host subgroups in each early host call, in backward order (the last
      subgroups first); the last call takes the rest. `()`: one host call after the
      backward pass. Chosen by `early_host_calls` or the policy's cost model.
    disk: host-updated subgroups whose state is in files (`Tier.DISK`), ascending; not
      in `host` (`spill_to_disk` chooses them).
    disk_dir, direct_io: the disk tier's directory and I/O mode (`dos_jax.Disk`).
    disk_shards: the data shards of a state split over devices (ZeRO-1/3): each has
      its own files, of its columns of the rows.
    disk_replicas: the copies of each data shard on a mesh's other axes: each device
      reads and writes its own files, as it keeps its own copy of a state in memory.
    disk_axis: the mesh axis of the data shards (None: no mesh), which with the mesh
      names each device's files (`disk_files.local_files`).
  """

  host: tuple[int, ...]
  streamed: tuple[int, ...] = ()
  resident: tuple[int, ...] = ()
  two_memories: bool = True
  stream: tuple[int, ...] = ()
  buffers: int = 2
  early: tuple[int, ...] = ()
  disk: tuple[int, ...] = ()
  disk_dir: str | None = None
  direct_io: bool = True
  disk_shards: int = 1
  disk_replicas: int = 1
  disk_axis: str | None = None

  @property
  def plan(self) -> Plan:
    """The plan this partition runs (its placements, stream order and buffers)."""
    return Plan(streamed=self.stream or self.streamed,
                host=tuple(sorted(self.host + self.disk)), resident=self.resident,
                buffers=self.buffers)

  @property
  def spill(self) -> 'DiskSpill | None':
    """The disk tier's rule as this partition keeps it (as many host subgroups in
    memory as it has), or None without a disk tier."""
    if not self.disk:
      return None
    return DiskSpill(self.disk_dir, len(self.host), self.direct_io, self.disk_shards,
                     self.disk_replicas, self.disk_axis)

  def with_early(self, early: tuple[int, ...] | None) -> 'Partition':
    """This partition with other early host calls (None: `early_host_calls`' rule)."""
    if early is not None and sum(early) >= len(self.host):
      early = None  # chosen for more host subgroups in memory than this partition has
    early = early_host_calls(len(self.host)) if early is None else tuple(early)
    return dataclasses.replace(self, early=early if self.two_memories else ())

  def __post_init__(self):
    for tier in TIERS + (Tier.DISK,):
      ids = self.ids(tier)
      if list(ids) != sorted(set(ids)):
        raise ValueError(f'Partition.{tier.value} must be ascending and distinct: {ids}')
    if self.disk and not self.disk_dir:
      raise ValueError(f'Partition.disk needs a disk_dir: {self}')
    everything = sorted(self.host + self.streamed + self.resident + self.disk)
    if everything != list(range(len(everything))):
      raise ValueError(f'Partition must name every subgroup exactly once: {self}')

  def ids(self, tier: Tier) -> tuple[int, ...]:
    return getattr(self, tier.value)

  @property
  def num_subgroups(self) -> int:
    return len(self.host) + len(self.streamed) + len(self.resident) + len(self.disk)

  def local(self, tier: Tier, subgroups: Sequence[int]) -> tuple[int, ...]:
    """Rows of `tier`'s array that hold `subgroups` (which must all be in it)."""
    where = {g: i for i, g in enumerate(self.ids(tier))}
    return tuple(where[g] for g in subgroups)

  def blocks(self, tier: Tier) -> tuple[tuple[int, ...], ...]:
    """The subgroups of each of `tier`'s blocks, in storage order: one block per
    subgroup (the two-memory program), or the whole tier as one block (also when it is
    empty: its arrays then have no row)."""
    ids = self.ids(tier)
    if self.two_memories:
      return tuple((g,) for g in ids)
    return (ids,)

  def locate(self, subgroup: int) -> tuple[Tier, int, int]:
    """`(tier, block, row)`: where `subgroup`'s state is stored."""
    tier = self.tier_of(subgroup)
    for b, ids in enumerate(self.blocks(tier)):
      if subgroup in ids:
        return tier, b, ids.index(subgroup)
    raise AssertionError(subgroup)  # every subgroup of a tier is in one of its blocks

  def tier_of(self, subgroup: int) -> Tier:
    for tier in TIERS + (Tier.DISK,):
      if subgroup in self.ids(tier):
        return tier
    raise ValueError(f'subgroup {subgroup} is in no tier of {self}')


MAX_HOST_CALLS = 4


def early_host_calls(host_subgroups: int) -> tuple[int, ...]:
  """The fixed rule for the early host calls when no cost model chooses them: the host
  subgroups in `min(H, MAX_HOST_CALLS)` calls of near-equal size (H host subgroups),
  all but the last early; none for fewer than two host subgroups.

  >>> early_host_calls(1), early_host_calls(2), early_host_calls(10)
  ((), (1,), (3, 3, 2))
  """
  calls = min(host_subgroups, MAX_HOST_CALLS)
  if calls < 2:
    return ()
  sizes = [host_subgroups // calls + (k < host_subgroups % calls) for k in range(calls)]
  return tuple(sizes[:-1])


def host_calls(items, early) -> list[list]:
  """`items` (host blocks or subgroups, in backward order) as the host calls take them:
  `early` an int K, K calls of near-equal size; a tuple of sizes, one early call of
  each size in turn and a last call with the rest. The last call is never empty (a
  tuple covering every item makes its last call the last)."""
  items = list(items)
  if isinstance(early, int):
    count = max(1, min(early, len(items)))
    return [list(a) for a in np.array_split(np.asarray(items, dtype=object), count)]
  parts, at = [], 0
  for size in early:
    if at + size >= len(items):
      break
    parts.append(items[at:at + size])
    at += size
  return parts + [items[at:]]


def for_plan(plan: Plan, two_memories: bool, early: tuple[int, ...] | None = None,
             disk: 'DiskSpill | None' = None) -> Partition:
  """The partition a plan runs on.

  With `two_memories` (the two-memory program) each of the plan's three placements is its
  own tier: resident subgroups in device memory, streamed and host subgroups in pinned
  host memory, one block per subgroup; `early` gives its early host calls (None: the
  rule, `early_host_calls`). Without it (one memory, the CPU program) every subgroup
  takes the same path and the state is one array: the resident tier when the plan keeps
  everything resident, else the host tier. `disk` moves the host subgroups beyond its
  budget to the disk tier (`spill_to_disk`).
  """
  everything = tuple(range(plan.num_subgroups))
  if plan.all_resident:
    return Partition(host=(), resident=everything, two_memories=two_memories)
  if not two_memories:
    host, on_disk = spill_to_disk(everything, disk)
    return Partition(host=host, two_memories=False, **_disk_fields(on_disk, disk))
  host, on_disk = spill_to_disk(tuple(sorted(plan.host)), disk)
  part = Partition(host=host, streamed=tuple(sorted(plan.streamed)),
                   resident=tuple(sorted(plan.resident)), stream=tuple(plan.streamed),
                   buffers=plan.buffers, **_disk_fields(on_disk, disk))
  return part.with_early(early)


@dataclasses.dataclass(frozen=True)
class DiskSpill:
  """What decides the disk tier: its directory and I/O mode, and how many host
  subgroups may stay in memory (None: none; `dos_jax.Disk.host_state_bytes` over one
  subgroup's state bytes)."""

  directory: str
  in_memory: int | None = None
  direct_io: bool = True
  shards: int = 1
  replicas: int = 1
  axis: str | None = None  # the mesh axis of the shards


def spill_to_disk(host: tuple[int, ...], disk: DiskSpill | None
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`(in memory, on disk)`: the host subgroups (ascending) split by `disk`'s budget.
  The last subgroups stay in memory: their gradients come first, for the early host
  calls; the first ones, whose gradients come last, go to disk.

  >>> spill_to_disk((0, 2, 3, 5), DiskSpill('/d', in_memory=1))
  ((5,), (0, 2, 3))
  """
  if disk is None:
    return host, ()
  keep = 0 if disk.in_memory is None else min(disk.in_memory, len(host))
  cut = len(host) - keep
  return host[cut:], host[:cut]


def _disk_fields(on_disk: tuple[int, ...], disk: DiskSpill | None) -> dict:
  if not on_disk:
    return {}
  return dict(disk=on_disk, disk_dir=disk.directory, direct_io=disk.direct_io,
              disk_shards=disk.shards, disk_replicas=disk.replicas, disk_axis=disk.axis)


def stream_order(part: Partition, streamed: Sequence[int]) -> list[int]:
  """The streamed tier's blocks in stream order: `streamed` (a plan's `streamed`
  subgroups, in the order the stream reaches them) as the indices of the blocks that
  start with them."""
  first_row = {ids[0]: b for b, ids in enumerate(part.blocks(Tier.STREAMED))}
  return [first_row[g] for g in streamed if g in first_row]


def blocks_of(arrays: Sequence[jax.Array], count: int) -> list[tuple[jax.Array, ...]]:
  """A tier's flat tuple of arrays (block-major: each block's arrays, one per dtype)
  as `count` blocks."""
  if not count:
    return []
  width = len(arrays) // count
  return [tuple(arrays[b * width:(b + 1) * width]) for b in range(count)]


@dataclasses.dataclass(frozen=True)
class Piece:
  """A contiguous run of one leaf inside one tier.

  Shard-major (`Layout.shards` > 1) every field counts elements of one shard: a run of
  every device's shard of the leaf (`layout.to_shards`), at the same place in each.

  Attributes:
    leaf: the leaf's index in the layout's treedef order.
    start: first element of the run within the raveled leaf.
    size: elements in the run.
    offset: first element of the run within the tier's flat `(R * S)` rows.
  """

  leaf: int
  start: int
  size: int
  offset: int


def pieces_of(layout: Layout, ids: Sequence[int]) -> tuple[Piece, ...]:
  """The runs of every leaf that fall in rows holding subgroups `ids` (in that order),
  ordered by leaf, then by start.

  A leaf that spans several of the subgroups gives one piece per run of consecutive
  rows (adjacent pieces are merged).
  """
  size = layout.shard_size
  local = {g: i for i, g in enumerate(ids)}
  out: list[Piece] = []
  for leaf, (offset, count) in enumerate(zip(layout.offsets, layout.shard_sizes)):
    cursor, end = offset, offset + count
    while cursor < end:
      row = cursor // size
      stop = min(end, (row + 1) * size)
      if row in local:
        piece = Piece(leaf=leaf, start=cursor - offset, size=stop - cursor,
                      offset=local[row] * size + cursor - row * size)
        last = out[-1] if out else None
        if (last is not None and last.leaf == leaf and last.start + last.size == piece.start
            and last.offset + last.size == piece.offset):
          out[-1] = dataclasses.replace(last, size=last.size + piece.size)
        else:
          out.append(piece)
      cursor = stop
  return tuple(out)


def slice_pieces(leaves: Sequence[jax.Array], runs: Sequence[Piece],
                 shards: int = 1) -> list[jax.Array]:
  """The 1-D arrays of `runs`, each a static slice of its raveled leaf (a whole leaf
  is passed as it is). With `shards` > 1 the leaves are shard-major
  (`layout.shard_views`) and each run is a `(shards, size)` slice of its leaf."""
  out = []
  for run in runs:
    flat = jnp.ravel(leaves[run.leaf]) if shards == 1 else leaves[run.leaf]
    whole = run.start == 0 and run.size == flat.shape[-1]
    out.append(flat if whole else jax.lax.slice_in_dim(flat, run.start, run.start + run.size,
                                                       axis=flat.ndim - 1))
  return out


# XLA's CPU backend computes a 16-bit float concatenate (or pad) in float32: a copy of
# twice the size. Their bits, as unsigned ints, are moved as they are.
_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def assemble(arrays: Sequence[jax.Array], runs: Sequence[Piece], rows: int, size: int,
             dtype, shards: int = 1) -> jax.Array:
  """`(rows, size)` rows of `dtype` from pieces placed at their offsets, zero elsewhere.

  Gaps are filled by `lax.pad` with a scalar, never a zeros array, so that assembling
  inside a host region stays in host memory. With `shards` > 1 (shard-major) the
  pieces are `(shards, n)` (`slice_pieces`), offsets count one shard's elements, and
  shard d's land in columns `[d * size / shards, (d + 1) * size / shards)` of the rows.
  """
  total = rows * size // shards
  if _BITS.get(jnp.dtype(dtype)) is not None:  # 16-bit floats move as their bits
    bits = _BITS[jnp.dtype(dtype)]
    as_bits = [jax.lax.bitcast_convert_type(x.astype(dtype), bits) for x in arrays]
    return jax.lax.bitcast_convert_type(assemble(as_bits, runs, rows, size, bits, shards), dtype)
  zero = jnp.zeros((), dtype)
  lead = [(0, 0, 0)] if shards > 1 else []
  order = sorted(range(len(runs)), key=lambda i: runs[i].offset)
  parts, cursor = [], 0
  for i in order:
    piece, run = arrays[i].astype(dtype), runs[i]
    gap = run.offset - cursor
    if gap:
      piece = jax.lax.pad(piece, zero, lead + [(gap, 0, 0)])
    parts.append(piece)
    cursor = run.offset + run.size
  if not parts:
    return jnp.zeros((rows, size), dtype)
  flat = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
  if cursor < total:
    flat = jax.lax.pad(flat, zero, lead + [(0, total - cursor, 0)])
  if shards > 1:
    return layout_lib.rows_from_shards(flat, rows)
  return flat.reshape(rows, size)


def leaves_from_blocks(blocks: Sequence[tuple[jax.Array, tuple[Piece, ...]]],
                       layout: Layout) -> list[jax.Array]:
  """The layout's leaves (treedef order) read back from `(R, S)` rows, each given with
  its pieces (`pieces_of` the subgroups it holds). Shard-major, each device reads its
  own columns of the rows (`layout.shards_from_rows`): no row is gathered."""
  runs_by_leaf: dict[int, list[tuple[int, int, Piece]]] = {}
  for b, (_, runs) in enumerate(blocks):
    for run in runs:
      runs_by_leaf.setdefault(run.leaf, []).append((run.start, b, run))
  flats = [layout_lib.shards_from_rows(rows, layout.shards) for rows, _ in blocks] \
      if layout.shards > 1 else None
  leaves = []
  for leaf, shape in enumerate(layout.shapes):
    parts = []
    for _, b, run in sorted(runs_by_leaf.get(leaf, []), key=lambda t: t[0]):
      flat = blocks[b][0].reshape(-1) if flats is None else flats[b]
      parts.append(jax.lax.slice_in_dim(flat, run.offset, run.offset + run.size,
                                        axis=flat.ndim - 1))
    whole = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    leaves.append(whole.reshape(shape) if layout.shards == 1
                  else layout_lib.from_shards(whole, layout, leaf))
  return leaves


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
  """`ids` as `(start, stop)` runs of consecutive values, in order."""
  out: list[tuple[int, int]] = []
  for i in ids:
    if out and out[-1][1] == i:
      out[-1] = (out[-1][0], i + 1)
    else:
      out.append((i, i + 1))
  return out


def take_rows(x: jax.Array, ids: Sequence[int]) -> jax.Array:
  """`x[ids]` along the first axis with static slices, no index array: an index array
  would be a device constant, which a host region cannot mix with host arrays."""
  if not ids:
    return x[:0]
  parts = [x[a:b] for a, b in _runs(ids)]
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def merge_tiers(tiers: dict[Tier, tuple[jax.Array, ...]],
                partition: Partition) -> tuple[jax.Array, ...]:
  """The tiers' block arrays (all in one memory) as `(G, K, S)` arrays in subgroup
  order."""
  stored = [g for tier in TIERS for ids in partition.blocks(tier) for g in ids]  # concatenation order
  position = {g: i for i, g in enumerate(stored)}
  order = [position[g] for g in range(len(stored))]
  blocks = [block for tier in TIERS if partition.ids(tier)
            for block in blocks_of(tiers[tier], len(partition.blocks(tier)))]
  merged = []
  for j in range(len(blocks[0])):
    parts = [block[j] for block in blocks]
    whole = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    merged.append(whole if order == sorted(order) else take_rows(whole, order))
  return tuple(merged)


def split_tiers(rows: tuple[jax.Array, ...],
                partition: Partition) -> dict[Tier, tuple[jax.Array, ...]]:
  """`(G, K, S)` arrays in subgroup order -> each tier's block arrays (block-major)."""
  return {tier: tuple(take_rows(x, ids) for ids in partition.blocks(tier) for x in rows)
          for tier in TIERS}
