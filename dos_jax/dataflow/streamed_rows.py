"""The streamed rows of a compiled program: each asynchronous host->device fetch of a
state block (a `dynamic-slice` of a stacked tier or a `copy` of a per-subgroup row) and
the device->host write-back computed from it, per computation (see `schedule`'s module
docstring for what *prefetched* and *full duplex* mean)."""

from __future__ import annotations

import dataclasses
import re

from dos_jax.dataflow import hlo


@dataclasses.dataclass(frozen=True)
class StreamedRow:
  """One state block fetched host->device, and its write-back, in one computation."""

  computation: str
  fetch: str  # the fetch's start
  nbytes: int
  write_back: str | None  # the first device->host write computed from the fetched block
  after_previous_write_back: bool  # the fetch depends on the previous row's write-back
  # This row's write-back depends on the next row's fetch: the two cannot be in flight
  # together, so the link carries one direction at a time.
  write_back_after_next_fetch: bool = False
  # The stream of rows this row is part of: its computation, or the scheduling group of
  # the stream lanes that run it (`lanes:<group>`); `streamed_rows` gives each stream's
  # rows together, in the order the stream reaches them.
  stream: str = ''


def _async_move(computation: hlo.Computation, start: hlo.Instruction) -> tuple[str, int] | None:
  """('fetch' | 'write_back', bytes) for an asynchronous copy or slice between host and
  device memory (`copy-start`, or a `fusion-start` of a dynamic (update-)slice), else
  None. A fetch reads host memory into device memory; a write-back writes device data
  into host memory."""
  if start.opcode not in ('copy-start', 'fusion-start'):
    return None
  operands = hlo.operand_arrays(computation, start)
  if not operands or not start.arrays:
    return None
  if start.opcode == 'fusion-start':
    calls = start.attribute('calls') or ''
    if 'dynamic_update_slice' in calls or 'dynamic-update-slice' in calls:
      # (into, update, indices...): a device update written into a host array.
      if len(operands) > 1 and operands[0].on_host and not operands[1].on_host:
        return 'write_back', operands[1].nbytes
      return None
    if 'dynamic_slice' not in calls and 'dynamic-slice' not in calls:
      return None
  source = operands[0]
  # A copy-start's shape is (result, operand, context); a fusion-start's is
  # ((operands...), result, context).
  index = 0 if start.opcode == 'copy-start' else len(operands)
  if len(start.arrays) <= index:
    return None
  result = start.arrays[index]
  if source.on_host and not result.on_host:
    return 'fetch', result.nbytes
  if not source.on_host and result.on_host and start.opcode == 'copy-start':
    return 'write_back', result.nbytes
  return None


def _data_operand(start: hlo.Instruction) -> str | None:
  """The operand a write-back moves: a copy's only one, a dynamic-update-slice's update."""
  index = 0 if start.opcode == 'copy-start' else 1
  return start.operands[index] if len(start.operands) > index else None


def streamed_rows(module: hlo.Module, min_bytes: int = 64 * 1024) -> list[StreamedRow]:
  """The streamed rows of every main-thread computation (see the module docstring)."""
  found = []
  for computation in module.reachable(module.entry):
    if computation.execution_thread == 'host':
      continue
    moves = {}
    for instruction in computation.instructions:
      move = _async_move(computation, instruction)
      if move is not None:
        moves[instruction.name] = move
    fetches = [n for n, (kind, size) in moves.items() if kind == 'fetch' and size >= min_bytes]
    if not fetches:
      continue
    users = _users(computation)

    def descendants(name: str) -> set[str]:
      return _descendants(users, name)

    position = {i.name: i.position for i in computation.instructions}
    by_name = computation.by_name()
    rows, own = [], set()
    for fetch in fetches:
      downstream = descendants(fetch)
      # The row's own write-back carries data computed from the fetched block: its
      # update operand (a copy's only operand) descends from the fetch. (The tier it
      # is written into may descend from later fetches: they read it first.)
      write_backs = sorted((n for n in downstream if moves.get(n, ('',))[0] == 'write_back'
                            and _data_operand(by_name[n]) in downstream), key=position.get)
      rows.append((fetch, write_backs[0] if write_backs else None))
      own.update(write_backs[:1])
    # The rows in the order they are updated: first those fetched before this
    # computation (a loop body's carried blocks: a write-back from no fetch here), then
    # the fetched ones by write-back (a fetch may be issued before the fetch of the row
    # updated before it), then those written back after it (carried out of a loop body).
    carried = [(None, n) for n, (kind, size) in moves.items()
               if kind == 'write_back' and size >= min_bytes and n not in own]
    rows.sort(key=lambda row: (row[1] is None, position.get(row[1] or row[0])))
    rows = sorted(carried, key=lambda row: position[row[1]]) + rows
    previous_write_back = None
    for j, (fetch, write_back) in enumerate(rows):
      next_fetch = next((f for f, _ in rows[j + 1:] if f is not None), None)
      waits = (write_back is not None and next_fetch is not None
               and write_back in descendants(next_fetch))
      if fetch is not None:
        after = previous_write_back is not None and fetch in descendants(previous_write_back)
        found.append(StreamedRow(computation=computation.name, fetch=fetch,
                                 nbytes=moves[fetch][1], write_back=write_back,
                                 after_previous_write_back=after,
                                 write_back_after_next_fetch=waits,
                                 stream=computation.name))
      previous_write_back = write_back
  return _interleave_lanes(module, found)


def _users(computation: hlo.Computation) -> dict[str, list[str]]:
  """{instruction name: the names of the instructions that use it}."""
  users: dict[str, list[str]] = {}
  for instruction in computation.instructions:
    for operand in instruction.operands:
      users.setdefault(operand, []).append(instruction.name)
  return users


def _descendants(users: dict[str, list[str]], name: str) -> set[str]:
  """Every instruction that uses `name`, directly or not."""
  seen, stack = set(), [name]
  while stack:
    for user in users.get(stack.pop(), ()):
      if user not in seen:
        seen.add(user)
        stack.append(user)
  return seen


def _stream_lanes(module: hlo.Module) -> dict[str, list[tuple[hlo.Instruction, set[str]]]]:
  """The entry's stream calls (`call-start` with `_xla_stream_annotation`) that share a
  lanes name (`device_stream.LANES_ATTRIBUTE`, else a `_scheduling_group_id`) with
  another, by stream: {group: [(the call's start, the computations it runs)]}."""
  groups: dict[str, list[tuple[int, hlo.Instruction]]] = {}
  for start in module.entry_computation.instructions:
    if start.opcode != 'call-start':
      continue
    stream = re.search(r'_xla_stream_annotation="(\d+)"', start.attributes)
    group = (re.search(r'_dos_jax_lanes="([^"]+)"', start.attributes)
             or re.search(r'_scheduling_group_id="([^"]+)"', start.attributes))
    if stream and group:
      groups.setdefault(group.group(1), []).append((int(stream.group(1)), start))
  return {group: [(start, {c.name for n in start.called for c in module.reachable(n)})
                  for _, start in sorted(calls, key=lambda c: c[0])]
          for group, calls in groups.items() if len(calls) > 1}


def _interleave_lanes(module: hlo.Module, found: list[StreamedRow]) -> list[StreamedRow]:
  """Rows run by the stream calls of one scheduling group (`stream lanes`, one stream
  each, lane k the k-th, (k + lanes)-th, ... row of the stream) read as one stream:
  row i's previous row is row i - 1 of the lane before it, and it depends on that
  row's write-back (or the next row on its fetch) only through the entry, when one
  call starts from what another's done returns."""
  lanes = _stream_lanes(module)
  if not lanes:
    return found
  entry = module.entry_computation
  users = _users(entry)

  def reaches(source: str, target: str) -> bool:
    return target in _descendants(users, source)

  done_of = {i.operands[0]: i.name for i in entry.instructions
             if i.opcode == 'call-done' and i.operands}
  replaced, sequences = {}, {}
  for group, calls in lanes.items():
    per_lane = [[r for r in found if r.computation in computations]
                for _, computations in calls]
    sequence = [(k, rows[j]) for j in range(max(len(rows) for rows in per_lane))
                for k, rows in enumerate(per_lane) if j < len(rows)]
    for i, (k, row) in enumerate(sequence):
      start = calls[k][0].name
      # Neighbours in one lane (only where lanes are uneven) keep what the lane's
      # computation says of them.
      after, waits = row.after_previous_write_back, row.write_back_after_next_fetch
      if i == 0:
        after = False
      if i + 1 == len(sequence):
        waits = False
      if i > 0 and sequence[i - 1][0] != k:
        previous_done = done_of.get(calls[sequence[i - 1][0]][0].name)
        after = previous_done is not None and reaches(previous_done, start)
      if i + 1 < len(sequence) and sequence[i + 1][0] != k:
        next_start = calls[sequence[i + 1][0]][0].name
        waits = next_start in done_of and reaches(done_of[next_start], start)
      replaced[id(row)] = dataclasses.replace(
          row, after_previous_write_back=after, write_back_after_next_fetch=waits,
          stream=f'lanes:{group}')
    members = {id(row) for _, row in sequence}
    first = next((r for r in found if id(r) in members), None)
    if first is not None:
      sequences[id(first)] = [replaced[id(row)] for _, row in sequence]
  ordered = []
  for row in found:
    if id(row) in sequences:
      ordered.extend(sequences[id(row)])
    elif id(row) not in replaced:
      ordered.append(row)
  return ordered
