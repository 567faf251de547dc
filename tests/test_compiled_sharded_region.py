"""A stream region (`dos_jax.step.device_stream`) in a program sharded over 4 GPUs,
compiled for H100s with no GPU: why a sharded state runs the construction of rule 1
(docs/design.md) inside `shard_map`, and the runner's ZeRO-3 step that does.

The probe: a region that fetches a pinned-host shard, updates it with a device
gradient and writes it back, its results used outside, all sharded over an `fsdp`
axis of 4 devices.

* Partitioned by jit (the state's sharding left to the SPMD partitioner), the one
  region compiles to several stream calls: tuple elements of the region's result
  become calls on the region's stream of their own, outside its window (on the
  runner's ZeRO-3 step: 18 stream calls and 7 host calls; without shard-major packing
  the collective-permute combiner merges two lanes' annotations into "1,2" and XLA
  stops on a failed check).
* Inside `shard_map` (each device running the region on its own shards) it stays one
  stream call. A state packed shard-major runs the whole construction so
  (`lanes.sharded_two_streams`): host regions and stream lanes on each device's
  own columns, the lanes' results behind an optimization barrier (read piecewise,
  their tuple elements became stream calls too).

Needs the CUDA plugin and JAX_PLATFORMS=cpu with 4 CPU devices (tests/conftest.py sets
8); skipped elsewhere.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import lowering as lowering_lib
from dos_jax import dataflow
from dos_jax.step import device_stream
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()


def _stream_calls(in_shard_map: bool):
  if jax.device_count() < 4:
    pytest.skip('needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)')
  dataflow.compile.prepare()
  mesh = jax.sharding.Mesh(jax.devices()[:4], ('fsdp',))
  group = device_stream.next_group()

  def region(state, grad):
    rows = jax.device_put(state, jax.memory.Space.Device)
    new = rows * 0.9 + grad
    return jax.device_put(new, jax.memory.Space.Host), new * 2

  update = device_stream.on_stream(region, group)
  if in_shard_map:
    update = jax.shard_map(update, mesh=mesh, in_specs=(P('fsdp'), P('fsdp')),
                           out_specs=(P('fsdp'), P('fsdp')))

  def step(state, grad, w):
    state, out = update(state, grad)
    return state, w + out, out.sum()

  device = NamedSharding(mesh, P('fsdp'))
  host = NamedSharding(mesh, P('fsdp'), memory_kind='pinned_host')
  args = (jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=host),
          jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=device),
          jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=device))
  lowered = dataflow.lower_for_gpu(step, *args, donate_argnums=(0,))
  return dataflow.compile_lowered(lowered, 'h100_sxm').schedule.stream_calls


def test_a_region_partitioned_by_jit_falls_apart_into_several_stream_calls():
  """Strict about each plugin: several calls on 0.11.2 and 0.12.0.1, one on 0.12.1 (the
  step keeps its sharded construction in `shard_map`, which holds on all three). If this
  fails, jit's partitioning of a region changed again."""
  calls = _stream_calls(in_shard_map=False)
  assert sum(c.updates for c in calls) == 1, calls
  if tuple(jax.__version_info__[:3]) >= (0, 12, 1):
    assert len(calls) == 1, calls
  else:
    assert len(calls) > 1, calls


def test_a_region_inside_shard_map_stays_one_stream_call():
  (call,) = _stream_calls(in_shard_map=True)
  assert call.updates, call


def _updates_beside_host_calls(schedule):
  """(host calls, stream calls updating device rows) of a step whose construction holds on
  either lowering: the host calls chained, every device update on a stream call that
  overlaps a host call, none outside every host call's window."""
  calls = schedule.host_calls
  assert calls and all(a.done < b.start for a, b in zip(calls, calls[1:])), calls
  lanes = [c for c in schedule.stream_calls if c.updates]
  assert lanes and all(any(c.overlaps(h) for h in calls) for c in lanes), (lanes, calls)
  assert not schedule.device_updates_outside_host_calls(), (calls, lanes)
  return calls, lanes


def _assert_stages(schedule, early: int):
  """The staged lowering (`dos_jax.step.stages`) inside `shard_map`: after the `early`
  host calls, one host call per stage (here more than one), each overlapping the stream
  calls of its own stage (one per lane, two lanes at the project's limit), and every
  stream call beside one of them."""
  calls = schedule.host_calls
  staged = calls[early:]
  lanes = [c for c in schedule.stream_calls if c.updates]
  beside = [[c for c in lanes if c.overlaps(h)] for h in staged]
  assert len(staged) > 1 and all(1 <= len(b) <= 2 for b in beside), (staged, lanes)
  assert all(any(c.overlaps(h) for h in staged) for c in lanes), (staged, lanes)


MESHES = {'zero3': ('mesh.data=1', 'mesh.fsdp=4'), 'zero1': ('mesh.data=4',)}


def _runners_zero3_step(*overrides, zero='zero3', early=None):
  """The runner's tiny step over fsdp=4 (or, `zero1`, data=4: the params whole on each
  device, the state split over `data`), bf16, the state packed shard-major and per
  subgroup (the two-memory program always is, where it is split), Stride(2),
  clipping, with the early host calls `early` (None: the builder's), compiled for 4
  H100s (skips where this jax builds no stream region or there are not 4 CPU
  devices)."""
  if jax.device_count() < 4:
    pytest.skip('needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)')
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(None, [
      *MESHES[zero], 'model.param_dtype=bfloat16', 'model.attention=xla',
      'offload.subgroup_size=65536', 'optim.clip_norm=1.0', 'offload.policy=stride',
      *overrides])
  return compiled.compile_runner_step(cfg, jax.devices()[:4], early=early)


@pytest.mark.parametrize('zero', sorted(MESHES))
def test_the_runners_zero3_step_runs_host_and_device_updates_in_one_group(zero):
  """The runner's tiny step, fsdp=4, the state packed shard-major and per subgroup,
  Stride(2), clipping: every device update beside a host call (one host call with both
  stream lanes on jax 0.11; a host call per stage with that stage's lanes on the staged
  lowering), and every host-bound gradient piece leaving during the backward
  pass (pieces of under 64 KiB here: each device sends its own shard of each leaf)."""
  schedule = _runners_zero3_step(zero=zero, early=()).schedule
  calls, lanes = _updates_beside_host_calls(schedule)
  if lowering_lib.of_version() is lowering_lib.Lowering.IN_REGION:
    assert len(calls) == 1 and len(lanes) == 2, (calls, lanes)
  else:  # a host call per stage, each with its own lanes' regions
    _assert_stages(schedule, early=0)
  copies = schedule.gradient_copies(min_bytes=1)
  assert copies and all(c.overlaps_compute for c in copies), copies
  assert not schedule.large_host_copies(), schedule.host_copies


@pytest.mark.parametrize('zero', sorted(MESHES))
def test_the_runners_zero3_step_starts_its_early_host_calls_during_the_backward_pass(zero):
  """The same step with three host calls of near-equal size: each device runs the early
  ones inside `shard_map` on its own columns, each chunk sending its own gradient pieces
  (no barrier over all of them), and the step is compiled with the early calls'
  profiled latency (`dataflow.early_windows`). The host calls chained: the two early
  ones, then the last (jax 0.11: both stream lanes beside it) or one per stage (staged); every early call profiled and none held back; an early
  window holds backward gemms; no device update outside a host call."""
  from dos_jax.dataflow import early_windows  # pylint: disable=import-outside-toplevel
  program = _runners_zero3_step('model.n_layers=4', zero=zero, early=3)
  schedule = program.schedule
  calls, lanes = _updates_beside_host_calls(schedule)
  if lowering_lib.of_version() is lowering_lib.Lowering.IN_REGION:
    assert len(calls) == 3 and all(c.overlaps(calls[-1]) for c in lanes), (lanes, calls)
  else:
    _assert_stages(schedule, early=2)
  assert program.early_calls_profiled == tuple(c.name for c in calls[:2])
  assert not early_windows.gemms_held_back(program.hlo_text)
  assert any(c.start < g < c.done for c in calls[:2] for g in schedule.gemm_positions), (
      calls, max(schedule.gemm_positions))


def test_the_runners_step_on_one_device_builds_the_unsharded_construction():
  """On one GPU the runner places the params on a one-device mesh, and the state keeps
  that mesh. A one-device mesh splits nothing, so the step is built as for an unsharded
  state: early host calls (here 2 of near-equal size) and the device tiers in stream
  lanes beside the host calls (jax 0.11: grouped with the last call; staged: a host call
  per stage), none outside a host call (the sharded path would have put every device
  update outside its one host call)."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(None, [
      'model.param_dtype=bfloat16', 'model.attention=xla', 'model.n_layers=4',
      'offload.subgroup_size=65536', 'optim.clip_norm=1.0', 'offload.policy=stride'])
  schedule = compiled.compile_runner_step(cfg, jax.devices()[:1], early=2).schedule
  calls, lanes = _updates_beside_host_calls(schedule)
  if lowering_lib.of_version() is lowering_lib.Lowering.IN_REGION:
    assert len(calls) == 2 and all(c.overlaps(calls[-1]) for c in lanes), (lanes, calls)
  else:
    _assert_stages(schedule, early=1)
