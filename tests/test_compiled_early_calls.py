"""Early host calls (`Partition.early`, `dos_jax.step.early_calls`) compiled for an H100,
over a family of MLP shapes (`tests.tooling.probes.mlp_step`: one subgroup per layer,
Stride(2), `dos_jax.clip_by_global_norm(1.0)`, native host kernel, the one construction),
with K host calls of near-equal size set through `dos_jax.migrate(..., early=...)` (the
rule's own K is `min(H, 4)`; tests/test_compiled_family.py checks the default).

What the construction holds in every program
(`test_early_host_calls_hold_their_construction`):

* K host calls, chained (each done before the next starts: the device link);
* the last call (the last call and the redo of the speculated ones) overlaps every
  stream lane of the device tiers, so no device update runs outside a host call;
* the stream is full duplex, and the state is never copied host to host (the undo is
  written by the kernel, not copied by XLA).

Where each early call starts (`test_early_host_calls_start_as_soon_as_their_operands_
allow`): XLA's latency-hiding scheduler places an asynchronous start, working back from
its done, once the work placed after it covers the call's estimated latency. The step
is compiled with a profile that gives every early call a latency no step covers
(`dataflow.early_windows`; the calls' names predicted from the lowered step, a second
compile where XLA names them otherwise), so the start goes as early as its
operands allow: no backward gemm that the call does not wait for is issued before it,
outside an earlier early window. Without the profile, programs with one early call
started it after the last gemm (RESULTS.md, 2026-11-26); this test fails if the
scheduler rule, or the attribute that marks the early calls, changes
(docs/design.md, rule 6).

Compiled with the CUDA plugin's compile-only client; skipped where it is not installed.
"""

import pytest

from dos_jax import lowering as lowering_lib
from dos_jax import dataflow
from dos_jax.dataflow import early_windows
from dos_jax.geometry import partition
from tests.tooling import probes
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

# (layers, width, dtype, call_count): 2-8 host subgroups, 256-4096 wide, odd and even
# layer counts, both dtypes, 1 to 4 early calls (experiments/schedule_family.py prints
# the default's whole family).
SHAPES = ((5, 4096, 'float32', 2), (7, 512, 'float32', 3), (8, 1024, 'bfloat16', 4),
          (16, 256, 'bfloat16', 4), (16, 1024, 'float32', 4), (6, 2048, 'bfloat16', 2),
          (10, 1024, 'float32', 2), (4, 256, 'float32', 2), (14, 768, 'bfloat16', 2),
          (11, 384, 'float32', 5))
_CACHE = {}


def _early(layers, call_count) -> tuple[int, ...]:
  """The early calls of `call_count` near-equal host calls over Stride(2)'s `layers // 2`
  host subgroups (`partition.host_calls`)."""
  return tuple(len(p) for p in partition.host_calls(range(layers // 2), call_count)[:-1])


def _schedule(layers, width, dtype, call_count):
  key = (layers, width, dtype, call_count)
  if key not in _CACHE:
    fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype,
                                           early=_early(layers, call_count))
    _CACHE[key] = dataflow.compile_for_gpu(fn, *args, **jit_kwargs)
  return _CACHE[key]


@pytest.mark.parametrize('layers, width, dtype, call_count', SHAPES, ids=lambda v: str(v))
def test_early_host_calls_hold_their_construction(layers, width, dtype, call_count):
  """The early calls, then the device tiers' stream calls inside the windows of the
  host calls after them, full duplex, no host->host copy."""
  schedule = _schedule(layers, width, dtype, call_count).schedule
  calls = schedule.host_calls
  staged = lowering_lib.of_version() is lowering_lib.Lowering.STAGED
  # The early calls and the last; staged, the last is one call per stage.
  assert len(calls) >= call_count if staged else len(calls) == call_count, calls
  assert all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  streams = schedule.stream_calls  # one per lane (and stage) of the device tiers
  late = calls[call_count - 1:]  # the calls after the early ones
  assert streams and all(s.updates and any(s.overlaps(c) for c in late)
                         for s in streams), (streams, late)
  assert not schedule.device_updates_outside_host_calls(), (calls, streams)
  assert schedule.stream_full_duplex(), schedule.streamed_rows
  assert not schedule.large_host_copies(), schedule.host_copies


@pytest.mark.parametrize('layers, width, dtype, call_count', SHAPES, ids=lambda v: str(v))
def test_early_host_calls_start_as_soon_as_their_operands_allow(layers, width, dtype, call_count):
  """Every early call was profiled, in one compile (XLA named the calls as
  `early_windows.predicted_early_calls` says), and no backward gemm it does not wait for
  is issued before its start outside an earlier early window."""
  program = _schedule(layers, width, dtype, call_count)
  calls = program.schedule.host_calls
  assert program.early_calls_profiled == tuple(c.name for c in calls[:call_count - 1]), (
      program.early_calls_profiled, calls)
  assert program.compiles == 1, program.early_calls_profiled
  assert not early_windows.gemms_held_back(program.hlo_text), (
      early_windows.gemms_held_back(program.hlo_text), calls)


@pytest.mark.parametrize('layers, width, dtype, call_count', SHAPES, ids=lambda v: str(v))
def test_early_host_calls_start_during_the_backward_pass(layers, width, dtype, call_count):
  """Some early call starts before the last backward gemm and before the last weight
  gradient leaves for the host, with backward gemms inside an early window."""
  schedule = _schedule(layers, width, dtype, call_count).schedule
  calls = schedule.host_calls
  last_gemm = max(schedule.gemm_positions)
  assert schedule.host_calls_started_before(last_gemm) >= 1, (calls, last_gemm)
  assert any(c.start < g < c.done for c in calls[:-1] for g in schedule.gemm_positions), (
      calls, schedule.gemm_positions)
  last_copy = max(c.start for c in schedule.gradient_copies() if c.to_host)
  assert calls[0].start < last_copy, (calls[0], last_copy)


def _state_blocks_returned(program) -> list[str]:
  """The (G, K, S) state blocks (rank 3) among the results of the program's host calls."""
  return [f'{d.name}: {a}' for d in compiled.host_call_dones(program) for a in d.arrays
          if len(a.dims) == 3]


@pytest.mark.parametrize('layers, width, dtype, call_count', SHAPES, ids=lambda v: str(v))
def test_no_host_call_returns_a_state_block(layers, width, dtype, call_count):
  """The state stays in host memory: every host call updates it in place, and a
  speculating early call's undo is the kernel library's own (`keep_undo`). A host call
  result that the program reads is a device buffer in XLA:GPU, so an undo returned by
  the early call held its blocks' state in device memory until the redo and copied it
  back (one (1, K, S) block per speculated subgroup, the 8 x 1024 step's 3 of 12.6 MB)."""
  program = _schedule(layers, width, dtype, call_count)
  assert not _state_blocks_returned(program), _state_blocks_returned(program)
  assert not compiled.host_results_sent_back(program), compiled.host_results_sent_back(program)


def test_a_wrong_name_prediction_costs_a_second_compile_not_the_windows(monkeypatch):
  """Where XLA names the early calls otherwise than `predicted_early_calls` says (here:
  the prediction names the last call, which must not be profiled), the step is compiled
  again with the names it has: every early call profiled, none held back."""
  layers, width, dtype, call_count = 4, 256, 'float32', 2
  right = _schedule(layers, width, dtype, call_count)
  last = right.schedule.host_calls[-1].name
  monkeypatch.setattr(early_windows, 'predicted_early_calls', lambda text: (last,))
  fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype,
                                         early=_early(layers, call_count))
  program = dataflow.compile_for_gpu(fn, *args, **jit_kwargs)
  assert program.compiles == 2, program.early_calls_profiled
  assert program.early_calls_profiled == right.early_calls_profiled
  assert not early_windows.gemms_held_back(program.hlo_text)
