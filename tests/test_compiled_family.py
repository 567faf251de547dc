"""Library steps over a family of shapes beyond the runner's presets, compiled for an
H100: what holds by construction, and what is still the scheduler's choice.

`dos_jax.dataflow.probes.mlp_step`: an L x W MLP, one subgroup per layer, Stride(2),
`dos_jax.clip_by_global_norm(1.0)`, the native host kernel (experiments/schedule_family.py
prints the whole family, RESULTS.md has the table). Held for every program:

* host-bound weight gradients leave the device while backward compute is issued;
* the stream is full duplex in both storages: no fetch waits for the previous row's
  write-back and no write-back for the next row's fetch (per subgroup every row is its
  own array; stacked, consecutive rows sit in interleaved blocks, `paths.interleaved_loop`);
* no host->host copy of the state.

* per subgroup (`Offload.device_stream`): the device tiers' update is one call on a GPU
  stream of its own, in one scheduling group with the host call, and the two windows
  overlap (`dos_jax.step.device_stream`; the scheduler rule it leans on is checked in
  `test_a_scheduling_group_is_placed_in_one_go_dones_after_starts`).

Held today by the scheduler's choice, not by construction: the stacked tier's one
update loop inside the host call's window (guarded here over the family); XLA 0.11.2
cannot give the stacked loop's asynchronous slices of host memory a stream inside a
stream region ("No ExecutionStreamId found", RESULTS.md).
"""

import pathlib

import pytest

from dos_jax import dataflow
from dos_jax.step import device_stream
from dos_jax.dataflow import probes
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

# (layers, width, dtype): odd and even streamed row counts, 256-4096 wide, both dtypes.
SHAPES = ((2, 4096, 'bfloat16'), (5, 512, 'float32'), (8, 1024, 'bfloat16'),
          (16, 256, 'bfloat16'))
_CACHE = {}


def _needs_stream_regions():
  if not device_stream.available():
    pytest.skip('this jax builds no stream region (device_stream.available())')


def _program(layers, width, dtype, storage):
  key = (layers, width, dtype, storage)
  if key not in _CACHE:
    fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype, storage=storage)
    _CACHE[key] = dataflow.compile_for_gpu(fn, *args, thunks=True, **jit_kwargs)
  return _CACHE[key]


@pytest.mark.parametrize('storage', ['stacked', 'per_subgroup'])
@pytest.mark.parametrize('layers, width, dtype', SHAPES, ids=lambda v: str(v))
def test_family_step_holds_what_its_construction_guarantees(layers, width, dtype, storage):
  if storage == 'per_subgroup':
    _needs_stream_regions()
  program = _program(layers, width, dtype, storage)
  schedule = program.schedule
  assert len(schedule.host_calls) == 1, schedule.host_calls
  copies = schedule.gradient_copies()
  assert copies and sum(not c.overlaps_compute for c in copies) <= 1, copies
  assert schedule.streamed_rows and schedule.stream_full_duplex(), schedule.streamed_rows
  assert not schedule.device_updates_outside_host_calls(), (
      schedule.host_calls, schedule.stream_calls)
  if storage == 'per_subgroup':
    # One stream region per lane (min(buffers, streamed rows)), each on a stream of its
    # own, every one overlapping the host call; consecutive rows on different streams.
    lanes = min(2, len(schedule.streamed_rows))
    assert schedule.device_updates_on_streams() == lanes, schedule.stream_calls
    assert schedule.device_updates() == tuple(sorted(c.start for c in schedule.stream_calls))
    regions = program.thunks.regions()
    assert len({r.stream for r in regions}) == len(regions) == lanes, regions
    assert not program.transfers_one_after_another(), schedule.streamed_rows
  assert not schedule.large_host_copies(), schedule.host_copies


def test_one_stream_region_runs_its_transfers_one_after_another():
  """What the lanes are for, and the XLA behaviour they answer: XLA 0.11 runs a stream
  region's copies synchronously, in order, on the region's stream (its stream
  assignment does not walk into an asynchronous call: `dataflow.thunks`). With the
  device tiers in one region (`Offload(stream_lanes=1)`, the form before lanes) every
  row's write-back runs before the next row's fetch, although the schedule's
  dependencies allow both at once. If a jax upgrade makes these copies asynchronous,
  this fails: docs/design.md, rule 3, must then be revisited."""
  _needs_stream_regions()
  fn, args, jit_kwargs = probes.mlp_step(5, 512, dtype='float32', storage='per_subgroup',
                                         stream_lanes=1)
  program = dataflow.compile_for_gpu(fn, *args, thunks=True, **jit_kwargs)
  schedule = program.schedule
  assert len(program.thunks.regions()) == 1, program.thunks.regions()
  assert len(schedule.streamed_rows) == 3 and schedule.stream_full_duplex()
  assert len(program.transfers_one_after_another()) == 2, schedule.streamed_rows


def _group_probe(grouped: bool, chain: int = 6):
  """A host region and a stream region that share no value, the stream's input ready at
  once and the host call's after nothing either, with a chain of `chain` gemms beside
  them: (host call, stream call, gemm positions) of the compiled program."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dos_jax.step import device_stream  # pylint: disable=import-outside-toplevel
  from dos_jax.step import paths  # pylint: disable=import-outside-toplevel

  group = device_stream.next_group() if grouped else None

  def step(h, g, w, x):
    y = x
    w = device_stream.on_stream(lambda w, x: jnp.tanh(jnp.tanh(w @ x) @ x), group)(w, x)
    for _ in range(chain):
      y = jnp.tanh(y @ x)
    with device_stream.in_group(group) if grouped else contextlib.nullcontext():
      h = paths.host_region(lambda h, g: h * 0.9 + g)(h, g)
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
  """The XLA rule `Offload.device_stream` leans on: the latency-hiding scheduler places
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


@pytest.mark.parametrize('layers, width, chunks', [(5, 512, 2), (16, 1024, 4)])
def test_chunked_per_subgroup_steps_run_each_device_part_beside_its_host_call(
    layers, width, chunks):
  """`Offload(chunks=K)`, per-subgroup storage: K host calls linked through the device,
  each grouped with its device part on the device tiers' stream, so that host call k
  and device part k overlap, chunk after chunk."""
  _needs_stream_regions()
  fn, args, jit_kwargs = probes.mlp_step(layers, width, storage='per_subgroup', chunks=chunks)
  program = dataflow.compile_for_gpu(fn, *args, thunks=True, **jit_kwargs)
  schedule = program.schedule
  calls, streams = schedule.host_calls, schedule.stream_calls
  assert len(calls) == chunks, calls
  # Each chunk's device part: one stream call per lane with rows in the chunk, each
  # overlapping that chunk's host call (and no other).
  for call in calls:
    lanes = [s for s in streams if s.overlaps(call)]
    assert 1 <= len(lanes) <= 2 and all(s.updates for s in lanes), (call, streams)
  assert sum(1 for c in calls for s in streams if s.overlaps(c)) == len(streams), streams
  assert not program.transfers_one_after_another(), schedule.streamed_rows
  assert all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  assert not schedule.device_updates_outside_host_calls(), schedule.host_calls
  assert schedule.stream_full_duplex(), schedule.streamed_rows
  assert not schedule.large_host_copies(), schedule.host_copies


@pytest.mark.parametrize('storage', ['stacked', 'per_subgroup'])
def test_the_runner_125m_step_streams_full_duplex(storage):
  """The runner's 125m preset at batch 1 (12 layers x 640, 14 subgroups of 1e7, 7
  streamed): one host call, a full-duplex stream, no host->host copy of the state.
  Per subgroup the device tiers run in two lanes, each on its stream, beside the host
  call; stacked (two
  interleaved blocks) where the loop lands is the scheduler's choice
  (experiments/timeline_vs_schedule.py, RESULTS.md)."""
  if storage == 'per_subgroup':
    _needs_stream_regions()
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from dos_jax.train import gpu_program  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(str(pathlib.Path(__file__).parents[1] / 'configs' / '125m.yaml'),
                        ['data.batch_size=1', f'offload.storage={storage}'])
  schedule = gpu_program.compile_step(cfg, 'h100_sxm').schedule
  assert len(schedule.host_calls) == 1, schedule.host_calls
  # Stacked: one loop; per subgroup: one stream region per lane (buffers = 2).
  assert len(schedule.device_updates()) == (1 if storage == 'stacked' else 2), \
      schedule.update_positions
  assert len(schedule.streamed_rows) >= 2 and schedule.stream_full_duplex(), \
      schedule.streamed_rows
  if storage == 'per_subgroup':
    assert schedule.device_updates_on_streams() == 2, schedule.stream_calls
    assert not schedule.device_updates_outside_host_calls(), schedule.stream_calls
  assert not schedule.large_host_copies(), schedule.host_copies


_NO_STREAM_FOR_SLICES = (
    "XLA 0.11.2 assigns no execution stream to an asynchronous slice of host memory inside "
    "a stream region (\"No ExecutionStreamId found for %dynamic-slice-start\"), in a loop or "
    "not; jax's own compute_on('gpu_stream:1') fails the same way. So stacked storage keeps "
    "its loop outside any stream region (RESULTS.md, 2026-11-25, sixth session)")


@pytest.mark.xfail(strict=True, raises=Exception, reason=_NO_STREAM_FOR_SLICES)
def test_a_stream_region_cannot_yet_slice_host_memory():
  """Strict: the jax whose XLA compiles this fails here, and stacked storage can then
  run its stream on the device tiers' stream too (`lanes.update_on_two_streams`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dos_jax.step import device_stream  # pylint: disable=import-outside-toplevel

  def rows_summed(stack, w):
    total = jnp.zeros_like(w)
    for i in range(stack.shape[0]):
      total = total + jax.device_put(stack[i], jax.memory.Space.Device).sum() * w
    return total

  dataflow.compile.prepare()
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  stack = jax.ShapeDtypeStruct((4, 1 << 16), jnp.float32, sharding=host)
  w = jax.ShapeDtypeStruct((8,), jnp.float32)
  dataflow.compile_for_gpu(device_stream.on_stream(rows_summed, None), stack, w)
