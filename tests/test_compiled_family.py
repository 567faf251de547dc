"""Library steps over a family of shapes beyond the runner's presets, compiled for an
H100: what holds by construction, and what is still the scheduler's choice.

`tests.tooling.probes.mlp_step`: an L x W MLP, one subgroup per layer, Stride(2),
`dos_jax.clip_by_global_norm(1.0)`, the native host kernel, with no `Offload` field
beyond the policy: the one construction every user gets (experiments/schedule_family.py
prints the whole family, RESULTS.md has the table). Held for every program
(issue 40, "Done when"), compiled with `GPU_COMPILER_OPTIONS`:

* every device update runs inside a host call's window: the device tiers are calls on
  GPU streams of their own (one stream lane per buffer, at most two), the first in one
  scheduling group with the last host call, whose windows then overlap in every
  schedule (`dos_jax.step.lanes`; the scheduler rule it leans on is checked in
  `test_a_scheduling_group_is_placed_in_one_go_dones_after_starts`), the second where
  `GPU_COMPILER_OPTIONS`' limit lets the scheduler place it beside a host call;
* the stream is full duplex: no fetch waits for the previous row's write-back and no
  write-back for the next row's fetch, in the schedule and on the CUDA streams
  (consecutive rows sit on different lanes);
* the host tier runs in `1 + len(Partition.early)` host calls (the rule
  `partition.early_host_calls`): at least 2 where there are two host subgroups or
  more, one of them starting during the backward pass;
* host-bound weight gradients leave the device while backward compute is issued;
* no host->host copy of the state.
"""

import pathlib

import jax
import pytest

import dos_jax
from dos_jax import dataflow
from dos_jax.geometry import partition as partition_lib
from dos_jax.step import device_stream
from tests.tooling import probes
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

# (layers, width, dtype): odd and even streamed row counts, 256-4096 wide, both dtypes,
# 1 to 8 host subgroups (one host call at 1; 2 to 4 from 2 on).
SHAPES = ((2, 4096, 'bfloat16'), (4, 4096, 'bfloat16'), (5, 512, 'float32'),
          (8, 1024, 'bfloat16'), (16, 256, 'bfloat16'))
_CACHE = {}


def _offloaded(opt_state) -> dos_jax.OffloadedState:
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  (state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  return state


def _program(layers, width, dtype):
  """(the compiled default step, its offloaded state)."""
  key = (layers, width, dtype)
  if key not in _CACHE:
    fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype)
    _CACHE[key] = (dataflow.compile_for_gpu(fn, *args, thunks=True, **jit_kwargs),
                   _offloaded(args[1]))
  return _CACHE[key]


@pytest.mark.parametrize('layers, width, dtype', SHAPES, ids=lambda v: str(v))
def test_family_step_holds_what_its_construction_guarantees(layers, width, dtype):
  program, state = _program(layers, width, dtype)
  schedule = program.schedule
  calls = schedule.host_calls
  host_subgroups = len(state.partition.host)
  # The host calls: one per early group by the rule, and the last (per stage, staged);
  # chained.
  assert state.partition.early == partition_lib.early_host_calls(host_subgroups)
  assert len(calls) == compiled.expected_calls(state)[0], (calls, state.partition.early)
  assert all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  if host_subgroups >= 2:
    # At least 2 host calls, one of them starting during the backward pass, with
    # backward gemms inside an early window.
    assert len(calls) >= 2, calls
    assert schedule.host_calls_started_before(max(schedule.gemm_positions)) >= 1, (
        calls, schedule.gemm_positions)
    assert any(c.start < g < c.done for c in calls[:-1] for g in schedule.gemm_positions), (
        calls, schedule.gemm_positions)
  # Every device update inside a host call's window: one stream region per lane
  # (min(buffers, streamed rows)), each on a stream of its own, each overlapping a host
  # call (the lane grouped with the last call overlaps it in every schedule; the other
  # where the scheduler finds room: `dos_jax.step.device_stream`).
  assert not schedule.device_updates_outside_host_calls(), (calls, schedule.stream_calls)
  _, stream_calls = compiled.expected_calls(state)
  assert schedule.device_updates_on_streams() == stream_calls, schedule.stream_calls
  assert schedule.device_updates() == tuple(sorted(c.start for c in schedule.stream_calls))
  assert any(s.overlaps(calls[-1]) for s in schedule.stream_calls), (
      schedule.stream_calls, calls[-1])
  regions = program.thunks.regions()
  lanes = min(2, len(schedule.streamed_rows))
  assert len({r.stream for r in regions}) == lanes and len(regions) == stream_calls, regions
  # Every fetch independent of the write-backs, in the schedule and on the streams.
  assert schedule.streamed_rows and schedule.stream_full_duplex(), schedule.streamed_rows
  assert not program.transfers_one_after_another(), schedule.streamed_rows
  # Host-bound weight gradients leave while backward compute is issued (a host call's
  # result sent back would not be a gradient:
  # `test_no_host_call_result_goes_back_to_host_memory`).
  copies = compiled.gradient_copies(program)
  assert copies and sum(not c.overlaps_compute for c in copies) <= 1, copies
  assert not schedule.large_host_copies(), schedule.host_copies


def test_no_host_call_result_goes_back_to_host_memory():
  """No host call result is copied back to host memory: XLA:GPU gives a host call's
  results that the program reads device buffers, so the speculating calls' undo is the
  kernel library's own (`keep_undo`) and the redo's out rows are asked for in device
  memory. Before, 3 state blocks of 12.6 MB each in the 8 x 1024 step went to the
  device and back (`dos_jax.step.early_calls`)."""
  program, _ = _program(8, 1024, 'bfloat16')
  assert not compiled.host_results_sent_back(program), sorted(
      compiled.host_results_sent_back(program))


def test_one_stream_region_runs_its_transfers_one_after_another():
  """What the lanes are for, and the XLA behaviour they answer: XLA 0.11 runs a stream
  region's copies synchronously, in order, on the region's stream (its stream
  assignment does not walk into an asynchronous call: `dataflow.thunks`). Three
  host-memory rows streamed through one region (fetch, update, write back; no row
  depends on another): every row's write-back runs before the next row's fetch on
  one stream, although the schedule's dependencies allow both at once. If a jax
  upgrade makes these copies asynchronous, this fails: docs/design.md, rule 3, must
  then be revisited."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def rows_through_one_region(rows):
    def region(*rows):
      fetched = [jax.device_put(r, jax.memory.Space.Device) for r in rows]
      return tuple(jax.device_put(f * 0.9 + 1.0, jax.memory.Space.Host) for f in fetched)
    return device_stream.on_stream(region, device_stream.next_group())(*rows)

  dataflow.compile.prepare()
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  row = jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=host)
  program = dataflow.compile_for_gpu(rows_through_one_region, (row, row, row),
                                     thunks=True, donate_argnums=(0,))
  schedule = program.schedule
  assert len(program.thunks.regions()) == 1, program.thunks.regions()
  assert len(schedule.streamed_rows) == 3 and schedule.stream_full_duplex(), \
      schedule.streamed_rows
  assert len(program.transfers_one_after_another()) == 2, schedule.streamed_rows


def _group_probe(grouped: bool, chain: int = 6):
  """A host region and a stream region that share no value, the stream's input ready at
  once and the host call's after nothing either, with a chain of `chain` gemms beside
  them: (host call, stream call, gemm positions) of the compiled program."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dos_jax import memory_spaces  # pylint: disable=import-outside-toplevel

  group = device_stream.next_group() if grouped else None

  def step(h, g, w, x):
    y = x
    w = device_stream.on_stream(lambda w, x: jnp.tanh(jnp.tanh(w @ x) @ x), group)(w, x)
    for _ in range(chain):
      y = jnp.tanh(y @ x)
    with device_stream.in_group(group) if grouped else contextlib.nullcontext():
      h = memory_spaces.host_region(lambda h, g: h * 0.9 + g)(h, g)
    return h, w + y

  dataflow.compile.prepare()
  device = jax.devices()[0]
  host = jax.ShapeDtypeStruct((1 << 20,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
      device, memory_kind='pinned_host'))
  square = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  schedule = dataflow.compile_for_gpu(step, host, host, square, square,
                                      donate_argnums=(0,)).schedule
  (call,), (stream,) = schedule.host_calls, schedule.stream_calls
  return call, stream, schedule.gemm_positions


def test_a_scheduling_group_is_placed_in_one_go_dones_after_starts():
  """The XLA rule the construction (`dos_jax.step.lanes`) leans on: the latency-hiding scheduler places
  a scheduling group's instructions in one go, an asynchronous done before (in program
  order: after) any start, so the host call's and the stream's windows overlap with no
  other instruction between them. Without the group the same program puts gemms inside
  both windows, so the annotation, not the program's shape, decides: if a jax upgrade
  changes the rule this fails, and docs/design.md's construction must be revisited."""
  call, stream, gemms = _group_probe(grouped=True)
  assert sorted([call.start, call.done, stream.start, stream.done]) == list(
      range(stream.start, stream.start + 4)), (call, stream)
  assert max(call.start, stream.start) < min(call.done, stream.done), (call, stream)
  call, stream, gemms = _group_probe(grouped=False)
  assert any(stream.start < g < stream.done for g in gemms), (stream, gemms)


def test_the_runner_125m_step_holds_the_construction():
  """The runner's 125m preset at batch 1 (12 layers x 640, 14 subgroups of 1e7, 7
  streamed, 7 on host), built through the one builder (`train.optimizer.build_optimizer`,
  via `gpu_program`): the host calls its state says (the cost model's choice for this
  machine's profile: one call at batch 1, whose backward pass is too short to hide an
  early call), any early one starting during the backward pass, the device tiers in two
  lanes, each on its stream, beside the last host call, a full-duplex stream, no
  host->host copy of the state."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from tests.tooling import gpu_program  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(str(pathlib.Path(__file__).parents[1] / 'configs' / '125m.yaml'),
                        ['data.batch_size=1'])
  state = gpu_program.build_step(cfg).offloaded_state
  early = state.partition.early
  schedule = compiled.compile_step(cfg).schedule
  calls = schedule.host_calls
  host_calls, stream_calls = compiled.expected_calls(state)  # per stage where staged
  assert len(calls) == host_calls, (calls, early)
  assert schedule.host_calls_started_before(max(schedule.gemm_positions)) >= min(
      1, len(early)), calls
  assert len(schedule.device_updates()) == stream_calls, schedule.update_positions
  assert schedule.device_updates_on_streams() == stream_calls, schedule.stream_calls
  assert not schedule.device_updates_outside_host_calls(), schedule.stream_calls
  assert len(schedule.streamed_rows) >= 2 and schedule.stream_full_duplex(), \
      schedule.streamed_rows
  assert not schedule.large_host_copies(), schedule.host_copies
