"""What a compiled GPU program's schedule does: the facts dos_jax's design depends on.

Read off the scheduled HLO (`hlo.Module`) of a step compiled for a GPU target:

* **gradient copies**: device->host `copy-start`/`copy-done` pairs in the entry
  computation (the host-bound gradients leaving the device). One *overlaps* compute when
  a matrix multiplication (a gemm fusion or a cuBLAS call) is issued between its start
  and its done: the copy then runs on its own stream while the backward pass goes on.
* **host calls**: the asynchronous host computations (`custom-call-start` on the
  "host" execution thread, i.e. `compute_on('device_host')` regions). Device work issued
  between a host call's start and done runs while the host computes; *device update*
  work there (a Pallas AdamW, or a loop streaming state through the device) is the
  paper's concurrent host and device update.
* **stream calls**: asynchronous calls on a GPU stream of their own (`call-start` with
  `_xla_stream_annotation`, `dos_jax.step.device_stream`). One that runs device update work
  counts as concurrent with a host call when their windows overlap: the stream's work
  is launched before the host call's done blocks the launch thread, and the host call
  does not wait for it (it waits for XLA's compute stream only).
* **host->host copies**: `copy` instructions from host memory to host memory, in the
  entry computation or any computation it calls. A donated state updated in place has
  none; each one is a pass over host memory every step.
* **streamed rows**: each asynchronous host->device fetch of a state block (a
  `dynamic-slice` of a stacked tier or a `copy` of a per-subgroup row) and the
  device->host write-back computed from it. The stream is *prefetched* when no row's
  fetch depends on the write-back of the row updated just before it, in the same
  computation (a loop body, whose first row may have been fetched by the iteration
  before, or the entry where the loop is unrolled): row i+1's copy to the device then
  runs while row i is updated.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from dos_jax.dataflow import hlo
from dos_jax.dataflow.streamed_rows import StreamedRow
from dos_jax.dataflow.streamed_rows import streamed_rows

# Custom-call targets of device kernels: Pallas (Triton, Mosaic GPU).
_PALLAS_TARGETS = ('__gpu$xla.gpu.triton', 'mosaic_gpu', 'mosaic_gpu_v2')
_GEMM_TARGETS = ('__cublas$gemm', '__cublas$lt$matmul', '__cudnn$')
# Instructions that issue no device work of their own.
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'call-done',
         'copy-start', 'copy-done', 'custom-call-start', 'custom-call-done',
         'async-start', 'async-done', 'after-all', 'add-dependency', 'opt-barrier',
         'partition-id', 'replica-id'}


@dataclasses.dataclass(frozen=True)
class Copy:
  """One asynchronous copy between memories in the entry computation."""

  name: str
  nbytes: int
  to_host: bool
  start: int  # schedule positions of copy-start and copy-done
  done: int
  gemms_between: int  # matrix multiplications issued between start and done
  compute_between: int  # device compute instructions issued between start and done
  after_gemm: bool  # the copied value is computed from a matrix multiplication's result

  @property
  def overlaps_compute(self) -> bool:
    """Device compute is issued while the copy is in flight."""
    return self.compute_between > 0


@dataclasses.dataclass(frozen=True)
class HostCall:
  """One asynchronous host computation in the entry computation."""

  name: str
  start: int
  done: int
  device_between: tuple[str, ...]  # device compute issued between start and done
  device_update_between: tuple[str, ...]  # of those, device update work


@dataclasses.dataclass(frozen=True)
class StreamCall:
  """One asynchronous call on another GPU stream, in the entry computation."""

  name: str
  start: int
  done: int
  updates: bool  # it runs device update work (a Pallas AdamW, a state fetch or write-back)

  def overlaps(self, call: HostCall) -> bool:
    """Whether this call's window and `call`'s overlap."""
    return self.start < call.done and call.start < self.done


@dataclasses.dataclass(frozen=True)
class HostCopy:
  """A host->host copy (`copy` with host memory on both sides)."""

  name: str
  computation: str
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The schedule facts of one compiled program (see the module docstring)."""

  copies: tuple[Copy, ...]
  host_calls: tuple[HostCall, ...]
  host_copies: tuple[HostCopy, ...]
  gemms: int  # matrix multiplications in the entry computation
  streamed_rows: tuple[StreamedRow, ...] = ()
  update_positions: tuple[int, ...] = ()  # entry positions of Pallas calls and update loops
  gemm_positions: tuple[int, ...] = ()  # entry positions of matrix multiplications
  stream_calls: tuple[StreamCall, ...] = ()

  @classmethod
  def from_text(cls, text: str) -> 'Schedule':
    return cls.from_module(hlo.Module.parse(text))

  @classmethod
  def from_module(cls, module: hlo.Module) -> 'Schedule':
    entry = module.entry_computation
    if not module.is_scheduled:
      raise ValueError('not a scheduled HLO module: compile the program first')
    kinds = [_kind(module, i) for i in entry.instructions]
    return cls(copies=tuple(_copies(entry, kinds)),
               host_calls=tuple(_host_calls(module, entry, kinds)),
               host_copies=tuple(_host_copies(module)),
               gemms=sum(1 for k in kinds if k == 'gemm'),
               streamed_rows=tuple(streamed_rows(module)),
               update_positions=tuple(i.position for i in entry.instructions
                                      if kinds[i.position] in ('pallas', 'update_loop')),
               gemm_positions=tuple(i.position for i in entry.instructions
                                    if kinds[i.position] == 'gemm'),
               stream_calls=tuple(_stream_calls(module, entry)))

  def gradient_copies(self, min_bytes: int = 64 * 1024) -> tuple[Copy, ...]:
    """Device->host copies of at least `min_bytes` of values computed from a matrix
    multiplication: weight gradients, not biases, and not parameters sent to the host
    as they are (fp32 params have no master: the host update reads them)."""
    return tuple(c for c in self.copies
                 if c.to_host and c.after_gemm and c.nbytes >= min_bytes)

  def large_host_copies(self, min_bytes: int = 1 << 20) -> tuple[HostCopy, ...]:
    return tuple(c for c in self.host_copies if c.nbytes >= min_bytes)

  def device_update_inside_host_call(self) -> bool:
    """Whether device update work is issued while some host call runs (in its window,
    or on a stream call whose window overlaps it)."""
    return any(call.device_update_between for call in self.host_calls) or any(
        c.updates and any(c.overlaps(h) for h in self.host_calls) for c in self.stream_calls)

  def device_updates(self) -> tuple[int, ...]:
    """Schedule positions of the entry's device update work: Pallas AdamW calls, loops
    that stream state through the device, and the starts of stream calls running such
    work."""
    return tuple(sorted(self.update_positions + tuple(
        c.start for c in self.stream_calls if c.updates)))

  def device_updates_outside_host_calls(self) -> tuple[int, ...]:
    """The device updates that no host call runs beside: issued outside every host
    call's window, or, on a stream call, in a window that overlaps none."""
    inside = [p for p in self.update_positions
              if not any(c.start < p < c.done for c in self.host_calls)]
    streams = [c.start for c in self.stream_calls
               if c.updates and not any(c.overlaps(h) for h in self.host_calls)]
    return tuple(sorted(inside + streams))

  def device_updates_on_streams(self) -> int:
    """How many stream calls run device update work."""
    return sum(c.updates for c in self.stream_calls)

  def stream_full_duplex(self) -> bool:
    """Whether consecutive streamed rows' transfers are independent both ways: no fetch
    waits for the previous row's write-back and no write-back waits for the next row's
    fetch (vacuously true without streamed rows)."""
    return not any(r.after_previous_write_back or r.write_back_after_next_fetch
                   for r in self.streamed_rows)

  def host_calls_started_before(self, position: int) -> int:
    """How many host calls start before schedule position `position`."""
    return sum(1 for c in self.host_calls if c.start < position)

  def stream_prefetched(self) -> bool:
    """Whether every streamed row's fetch is independent of the previous row's
    write-back (vacuously true without streamed rows)."""
    return not any(r.after_previous_write_back for r in self.streamed_rows)

  def summary(self, min_copy_bytes: int = 64 * 1024,
              min_host_copy_bytes: int = 1 << 20) -> dict:
    """The JSON-ready facts `experiments/compile_gpu.py` reports."""
    grads = self.gradient_copies(min_copy_bytes)
    large = self.large_host_copies(min_host_copy_bytes)
    return {
        'gradient_copies': len(grads),
        'gradient_copies_overlapping_compute': sum(c.overlaps_compute for c in grads),
        'gradient_copies_overlapping_gemms': sum(c.gemms_between > 0 for c in grads),
        'gemms': self.gemms,
        'host_calls': len(self.host_calls),
        'device_update_inside_host_call': self.device_update_inside_host_call(),
        'device_work_inside_host_call': [list(c.device_between) for c in self.host_calls],
        'large_host_to_host_copies': len(large),
        'large_host_to_host_copy_bytes': sum(c.nbytes for c in large),
        'streamed_row_fetches': len(self.streamed_rows),
        'streamed_fetches_after_previous_write_back': sum(
            r.after_previous_write_back for r in self.streamed_rows),
        'streamed_write_backs_after_next_fetch': sum(
            r.write_back_after_next_fetch for r in self.streamed_rows),
        'device_updates': len(self.update_positions),
        'device_updates_outside_host_calls': len(self.device_updates_outside_host_calls()),
        'device_updates_on_streams': self.device_updates_on_streams(),
        # Early host calls (docs/design.md rule 6): where the scheduler put them.
        'host_calls_starting_before_last_gemm': self.host_calls_started_before(
            max(self.gemm_positions, default=-1)),
        'gemms_inside_host_calls': sum(
            1 for c in self.host_calls for g in self.gemm_positions if c.start < g < c.done),
        'host_to_host_copies': [dataclasses.asdict(c) for c in self.host_copies],
    }


def _target(instruction: hlo.Instruction) -> str:
  return (instruction.attribute('custom_call_target') or '').strip('"')


def _kind(module: hlo.Module, instruction: hlo.Instruction) -> str:
  """'gemm', 'pallas', 'update_loop', 'loop', 'compute' or 'free' (no device work)."""
  op = instruction.opcode
  if op in _FREE:
    return 'free'
  if op == 'custom-call':
    target = _target(instruction)
    if target in _PALLAS_TARGETS or target.startswith('__gpu$'):
      return 'pallas'
    if target.startswith(_GEMM_TARGETS):
      return 'gemm'
    return 'compute'
  if op == 'fusion':
    # A gemm fusion: XLA:GPU's custom fusion kind with a gemm computation (Triton gemm
    # or cuBLAS), never a loop or input fusion.
    custom = (instruction.attribute('kind') or '') == 'kCustom'
    if custom and ('gemm' in (instruction.attribute('calls') or '')
                   or '__triton_gemm' in instruction.attributes):
      return 'gemm'
    return 'compute'
  if op == 'while':
    body = instruction.attribute('body') or ''
    return 'update_loop' if _updates_state(module, body.lstrip('%')) else 'loop'
  return 'compute'


def _updates_state(module: hlo.Module, body: str) -> bool:
  """Whether a loop body runs a Pallas kernel or moves data between host and device
  (streamed subgroups): the device half of an update."""
  for computation in module.reachable(body):
    for instruction in computation.instructions:
      if instruction.opcode == 'custom-call' and _kind(module, instruction) == 'pallas':
        return True
      if instruction.opcode in ('fusion-start', 'copy-start', 'dynamic-slice',
                                'dynamic-update-slice'):
        operands = hlo.operand_arrays(computation, instruction)
        if any(a.on_host for a in operands) != any(a.on_host for a in instruction.arrays[-1:]):
          return True
        if any(a.on_host for a in instruction.arrays) and instruction.opcode != 'fusion-start':
          return True
  return False


def _done_of(instructions: Iterable[hlo.Instruction], start: hlo.Instruction,
             opcode: str) -> hlo.Instruction | None:
  for instruction in instructions:
    if instruction.opcode == opcode and start.name in instruction.operands:
      return instruction
  return None


def _after_gemm(entry: hlo.Computation, kinds: list[str]) -> set[str]:
  """Names of the entry's instructions computed (transitively) from a gemm's result."""
  found = set()
  for instruction in entry.instructions:  # schedule order: operands come first
    if kinds[instruction.position] == 'gemm' or any(o in found for o in instruction.operands):
      found.add(instruction.name)
  return found


def _copies(entry: hlo.Computation, kinds: list[str]) -> list[Copy]:
  by_name, found = entry.by_name(), []
  after_gemm = _after_gemm(entry, kinds)
  for start in entry.instructions:
    if start.opcode != 'copy-start':
      continue
    done = _done_of(entry.instructions[start.position:], start, 'copy-done')
    source = by_name.get(start.operands[0]) if start.operands else None
    if done is None or source is None or not done.arrays or not source.arrays:
      continue
    to_host = done.arrays[0].on_host and not source.arrays[0].on_host
    between = kinds[start.position + 1:done.position]
    found.append(Copy(
        name=start.name, nbytes=done.arrays[0].nbytes, to_host=to_host,
        start=start.position, done=done.position,
        gemms_between=sum(1 for k in between if k == 'gemm'),
        compute_between=sum(1 for k in between if k != 'free'),
        after_gemm=start.name in after_gemm))
  return found


def _is_host_call(instruction: hlo.Instruction) -> bool:
  return instruction.opcode in ('custom-call-start', 'async-start', 'call-start') and (
      'async_execution_thread="host"' in instruction.attributes
      or _target(instruction) == 'HostExecute')


def _host_calls(module: hlo.Module, entry: hlo.Computation,
                kinds: list[str]) -> list[HostCall]:
  found = []
  for start in entry.instructions:
    if not _is_host_call(start):
      continue
    done_opcode = start.opcode.replace('-start', '-done')
    done = _done_of(entry.instructions[start.position:], start, done_opcode)
    if done is None:
      continue
    between = entry.instructions[start.position + 1:done.position]
    device = [i for i in between if kinds[i.position] != 'free']
    update = [i for i in device if kinds[i.position] in ('pallas', 'update_loop')]
    found.append(HostCall(name=start.name, start=start.position, done=done.position,
                          device_between=tuple(i.name for i in device),
                          device_update_between=tuple(i.name for i in update)))
  return found


def _stream_calls(module: hlo.Module, entry: hlo.Computation) -> list[StreamCall]:
  found = []
  for start in entry.instructions:
    if start.opcode != 'call-start' or '_xla_stream_annotation' not in start.attributes:
      continue
    done = _done_of(entry.instructions[start.position:], start, 'call-done')
    if done is None:
      continue
    updates = any(_updates_state(module, name) for name in start.called)
    found.append(StreamCall(name=start.name, start=start.position, done=done.position,
                            updates=updates))
  return found


def _host_copies(module: hlo.Module) -> list[HostCopy]:
  """`copy` instructions host -> host, in every computation reachable from the entry.

  In a host computation (execution thread "host") every buffer is host memory, so
  any copy there counts; elsewhere both sides must carry the host memory space.
  """
  found = []
  for computation in module.reachable(module.entry):
    on_host_thread = computation.execution_thread == 'host'
    for instruction in computation.instructions:
      if instruction.opcode != 'copy':
        continue
      result = instruction.arrays
      source = hlo.operand_arrays(computation, instruction)
      if not result:
        continue
      if on_host_thread or (all(a.on_host for a in result) and source
                            and all(a.on_host for a in source)):
        found.append(HostCopy(name=instruction.name, computation=computation.name,
                              nbytes=sum(a.nbytes for a in result)))
  return found
