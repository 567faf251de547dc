"""Early host calls issued as soon as their gradients are in host memory.

An early host call (`Partition.early`, `dos_jax.step.early_calls`) runs beside
the backward work the GPU launches between its start and its done. The step's data
dependencies put the start after the call's gradients, never *at* them: where it lands
is XLA's latency-hiding scheduler's choice, which places a start, working back from its
done, once the work placed after it covers the call's estimated latency. A profile for
that scheduler (XLA's `ProfiledInstructionsProto`, passed as the compile option
`fdo_profile`) that gives each early call a latency no step can cover
(`EARLY_CALL_LATENCY_US`) leaves it one place for the start: as early as its operands
allow. The profile names the calls by the names XLA gives them: predicted from the
lowered step (`predicted_early_calls`) and checked once it is compiled; where XLA named
them otherwise the step is compiled again with their names (docs/design.md, rule 6).

Example (the runner does this on a GPU; elsewhere the step has no early host call and
compiles once):

    >>> import jax, jax.numpy as jnp
    >>> from dos_jax import dataflow
    >>> compiled = dataflow.compile_step(jax.jit(lambda x: x * 2).lower(jnp.ones(3)))
    >>> compiled(jnp.ones(3)).tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, TypeVar
import warnings

from dos_jax.kernels import jax_internals
from dos_jax.dataflow import hlo
from dos_jax.dataflow import schedule as schedule_lib
from dos_jax.step import device_stream

# 1000 s: more than XLA's estimate of any step's work (the 1.3b runner step's whole
# program is far below it), so the scheduler cannot cover it and issues the start as
# early as its operands allow.
EARLY_CALL_LATENCY_US = 1e9

T = TypeVar('T')


def early_call_names(hlo_text: str) -> tuple[str, ...]:
  """The start instructions of a compiled program's early host calls: every host call
  but the last one that the step marked early (`device_stream.early_call`)."""
  module = hlo.Module.parse(hlo_text)
  if not module.is_scheduled:
    return ()
  return tuple(c.name for c in _early_calls(module))


def _early_calls(module: hlo.Module) -> list[schedule_lib.HostCall]:
  by_name = module.entry_computation.by_name()
  calls = schedule_lib.Schedule.from_module(module).host_calls
  marker = device_stream.EARLY_CALL_ATTRIBUTE + '='
  return [c for c in calls[:-1] if marker in by_name[c.name].attributes]


def gemms_held_back(hlo_text: str) -> tuple[int, ...]:
  """Entry positions of the matrix multiplications a compiled program issues before an
  early host call's start that the call does not wait for (not among its operands'
  producers) and that no earlier early call's window holds: work the call's window
  could have run beside. Empty when every early call starts as early as its operands
  allow."""
  module = hlo.Module.parse(hlo_text)
  entry = module.entry_computation
  by_name = entry.by_name()
  gemms = schedule_lib.Schedule.from_module(module).gemm_positions
  calls = _early_calls(module)
  held = []
  for k, call in enumerate(calls):
    waits_for = _producers(by_name, call.name)
    held += [g for g in gemms
             if g < call.start and entry.instructions[g].name not in waits_for
             and not any(c.start < g < c.done for c in calls[:k])]
  return tuple(sorted(set(held)))


def _producers(by_name: Mapping[str, hlo.Instruction], name: str) -> set[str]:
  """Every instruction `name` depends on, transitively, through its operands."""
  found, stack = set(), [name]
  while stack:
    for operand in by_name[stack.pop()].operands:
      if operand in by_name and operand not in found:
        found.add(operand)
        stack.append(operand)
  return found


def early_call_profile(names: tuple[str, ...]) -> bytes:
  """The `fdo_profile` (a `ProfiledInstructionsProto` in text form) giving each early
  host call `names` (`early_call_names`) the latency `EARLY_CALL_LATENCY_US`."""
  return ''.join(f'costs {{ name: "{n}" cost_us: {EARLY_CALL_LATENCY_US:g} }}\n'
                 for n in names).encode()


def predicted_early_calls(lowered_text: str) -> tuple[str, ...]:
  """XLA's names for a step's early host calls, predicted from the lowered step (its
  StableHLO text) before any compile: the early calls (`device_stream.early_call`,
  numbered) and the last call (one call per stage in the staged lowering,
  `device_stream.late_call`) make `calls` host calls, which XLA's host-call wrapper
  names `host-call.{calls}` (the last) to `host-call.{2 calls - 1}` (the first early
  one), in reverse order: the early ones are the `chunks` highest. An implementation detail of XLA, checked after the compile
  (`compile_profiled`). Not so inside `shard_map` (a mesh's step), where each host call
  keeps the name of the call XLA made of its region (`call.N`, numbered among all the
  program's calls): those steps compile twice. `()` for a step with no early call."""
  chunks = len(set(re.findall(device_stream.EARLY_CALL_ATTRIBUTE + r' = "(\d+)"', lowered_text)))
  if not chunks:
    return ()
  late = len(set(re.findall(device_stream.LATE_CALL_ATTRIBUTE + r' = "(\d+)"', lowered_text)))
  calls = chunks + max(1, late)  # the staged lowering: one host call per stage
  return tuple(jax_internals.host_call_name(n)
               for n in range(2 * calls - 1, 2 * calls - 1 - chunks, -1))


def compile_profiled(compile_fn: Callable[[Mapping[str, Any]], T],
                     hlo_text_of: Callable[[T], str],
                     predicted: tuple[str, ...] = ()) -> tuple[T, tuple[str, ...], int]:
  """`(program, early calls profiled, compiles)`: `compile_fn` with the profile of the
  `predicted` early calls (`predicted_early_calls`; none: no profile); when the
  program's early calls are not those, compiled again with the profile of the ones it
  has (a second compile).

  `compile_fn` takes extra compiler options; `hlo_text_of` reads a program's
  optimized HLO. Warns when the second program's early calls are not the ones the
  profile names (the profile then moved nothing)."""
  first = compile_fn({'fdo_profile': early_call_profile(predicted)} if predicted else {})
  names = early_call_names(hlo_text_of(first))
  if not names:
    return first, (), 1
  if set(names) == set(predicted):
    return first, names, 1
  second = compile_fn({'fdo_profile': early_call_profile(names)})
  if early_call_names(hlo_text_of(second)) != names:
    warnings.warn(f'dos_jax: the second compile renamed the early host calls {names}: '
                  'their profiled latency was not applied, so XLA placed them by its own '
                  'estimate (dos_jax.dataflow.early_windows)', RuntimeWarning, stacklevel=3)
    return second, (), 2
  return second, names, 2


def compile_step(lowered: Any) -> Any:
  """Compiles a lowered step (`jax.jit(step, ...).lower(...)`, a `jax.stages.Lowered`)
  with its early host calls issued as soon as their operands allow (module docstring);
  returns the `jax.stages.Compiled`. A step without early host calls compiles once."""
  compiled, _, _ = compile_profiled(
      lambda extra: lowered.compile(dict(extra)) if extra else lowered.compile(),
      lambda c: c.as_text(), predicted_early_calls(lowered.as_text()))
  return compiled
