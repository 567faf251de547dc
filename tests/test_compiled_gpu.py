"""The GPU program as XLA compiles it for an H100: the schedule a GPU will run.

Compiled with the CUDA plugin's compile-only client, no GPU needed
(`dos_jax.dataflow.compile_for_gpu`); skipped where the plugin is not installed (CI runs
these in its Python 3.12 stage with `jax[cuda13]==0.11.2`, the GPU machines' version).
The lowered-program tests (test_gpu_program.py) prove what XLA *may* overlap; these
prove what the compiled schedule *does*:

* weight-gradient copies to host memory run while backward compute is issued (all but
  at most one: the last gradient the backward pass makes has nothing left to overlap);
* the host tier runs in the host calls its state says (`Partition.early`: the early
  calls the cost model chose, and the last);
* the device update (streamed or resident tiers) runs on stream lanes whose windows
  overlap a host call's, for every plan with device subgroups;
* with XLA's default options neither holds, which is why the runner compiles with
  `dos_jax.GPU_COMPILER_OPTIONS`.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax import dataflow
from tests.tooling import probes
from dos_jax.train import config as config_lib
from tests.tooling import gpu_program
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

_AVAILABLE, _WHY = dataflow.gpu_compiler_available()
if not _AVAILABLE:
  pytest.skip(f'no GPU compiler here: {_WHY}', allow_module_level=True)
if jax.default_backend() != 'cpu':  # a GPU machine compiles for its own GPU elsewhere
  pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu', allow_module_level=True)

DEVICE_PLANS = ('stride', 'device_fraction')


def _config(policy: str, dtype: str, clip: bool = True, overrides=()):
  return config_lib.load(None, [
      f'offload.policy={policy}', f'model.param_dtype={dtype}',
      'offload.subgroup_size=65536', f'optim.clip_norm={1.0 if clip else "null"}',
      *overrides])


def _runner_step(policy: str, dtype: str, options=None, clip: bool = True, overrides=()):
  return compiled.compile_step(_config(policy, dtype, clip, overrides),
                               compiler_options=options)


def _calls(policy: str, dtype: str, clip: bool = True, overrides=()) -> tuple[int, int]:
  """(host calls, stream calls updating device rows) of the runner's step for this
  config (`gpu_program.build_step`, the one builder), under this jax's lowering:
  `compiled.expected_calls`."""
  state = gpu_program.build_step(_config(policy, dtype, clip, overrides)).offloaded_state
  return compiled.expected_calls(state, clip=clip)


def _host_calls(policy: str, dtype: str, clip: bool = True, overrides=()) -> int:
  """The host calls the runner's step for this config makes: one per early call its
  state holds, and the last (per stage, in the staged lowering)."""
  return _calls(policy, dtype, clip, overrides)[0]


@pytest.mark.parametrize('target', list(dataflow.GpuTarget), ids=lambda t: t.value)
def test_target_configs_build_a_topology(target):
  program = dataflow.compile_for_gpu(lambda x: jnp.tanh(x @ x), jnp.ones((128, 128)),
                                     target=target)
  assert program.schedule.gemms == 1
  assert program.target is target


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('policy', ['all_host', *DEVICE_PLANS])
def test_runner_step_overlaps_copies_and_updates(policy, dtype):
  program = _runner_step(policy, dtype)
  schedule = program.schedule
  assert program.native_host_kernel, 'the native kernel is registered for host regions'
  copies = compiled.gradient_copies(program)
  assert copies, 'host-bound weight gradients leave the device'
  late = [c.name for c in copies if not c.overlaps_compute]
  assert len(late) <= 1, f'{len(late)} of {len(copies)} gradient copies overlap nothing: {late}'
  assert len(schedule.host_calls) == _host_calls(policy, dtype), schedule.host_calls
  if policy in DEVICE_PLANS:
    assert schedule.device_update_inside_host_call(), schedule.host_calls
    assert schedule.streamed_rows and schedule.stream_full_duplex(), schedule.streamed_rows
  assert not schedule.large_host_copies()


def test_streamed_rows_stream_full_duplex_with_one_block_each():
  """The runner's Stride(2) step (bf16): no streamed row's host->device fetch waits for
  the previous row's write-back and no write-back for the next row's fetch (full
  duplex); no device copy of a state block is made (the Pallas kernel updates the
  fetched (3, S) block where it lands), and no host->host copy either."""
  cfg = config_lib.load(None, [
      'offload.policy=stride', 'model.param_dtype=bfloat16', 'offload.subgroup_size=65536'])
  program = compiled.compile_step(cfg)
  schedule = program.schedule
  assert len(schedule.streamed_rows) >= 2, schedule.streamed_rows
  assert schedule.stream_full_duplex(), schedule.streamed_rows
  block = 3 * 65536 * 4
  device_copy = re.compile(r'= f32\[(1,)?3,65536\]\{[0-9,]*\} copy\(')
  device_copies = [line for line in program.hlo_text.splitlines() if device_copy.search(line)]
  assert not device_copies, device_copies
  assert all(r.nbytes == block for r in schedule.streamed_rows)
  assert not schedule.large_host_copies(min_bytes=block)


def test_a_row_count_the_lanes_do_not_divide_streams_full_duplex_beside_the_host_call():
  """2 layers: 5 streamed rows over 2 stream lanes (3 and 2 rows, round-robin in
  stream order): one stream call per lane (per lane and stage, staged), every device
  update beside a host call, full duplex."""
  overrides = ['model.n_layers=2']
  schedule = _runner_step('stride', 'bfloat16', overrides=overrides).schedule
  assert len(schedule.streamed_rows) == 5, schedule.streamed_rows
  host_calls, stream_calls = _calls('stride', 'bfloat16', overrides=overrides)
  assert len(schedule.host_calls) == host_calls, schedule.host_calls
  assert schedule.device_updates_on_streams() == stream_calls, schedule.stream_calls
  assert not schedule.device_updates_outside_host_calls(), (
      schedule.host_calls, schedule.stream_calls)
  assert schedule.stream_full_duplex(), schedule.streamed_rows


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('policy', DEVICE_PLANS)
def test_runner_steps_run_the_device_tiers_beside_the_host_call(policy, dtype):
  """The one construction: the device tiers are calls on GPU streams of their own
  (`dos_jax.step.lanes`), whose windows overlap a host call's, and the host-bound
  gradients still leave during the backward pass."""
  program = _runner_step(policy, dtype)
  schedule = program.schedule
  host_calls, stream_calls = _calls(policy, dtype)  # per lane (and stage, staged)
  assert len(schedule.host_calls) == host_calls, schedule.host_calls
  assert schedule.device_updates_on_streams() == stream_calls, (
      schedule.host_calls, schedule.stream_calls)
  assert schedule.device_update_inside_host_call()
  assert not schedule.device_updates_outside_host_calls()
  copies = compiled.gradient_copies(program)
  assert copies and sum(not c.overlaps_compute for c in copies) <= 1, copies


@pytest.mark.parametrize('policy', DEVICE_PLANS)
def test_default_options_overlap_no_gradient_copy_but_keep_the_construction(policy):
  """The reason for GPU_COMPILER_OPTIONS: XLA's default schedule (same program) runs no
  gradient copy beside compute. The device tiers' update still lands inside the host
  call: the step is traced for the defaults' limit on asynchronous calls and its
  scheduling group holds under every option set (docs/design.md, "One construction")."""
  schedule = _runner_step(policy, 'bfloat16', options={}).schedule
  copies = schedule.gradient_copies()
  assert copies and not any(c.overlaps_compute for c in copies)
  assert schedule.device_update_inside_host_call(), schedule.host_calls


def test_library_step_overlaps_every_weight_gradient_but_the_last():
  """An L-layer bf16 MLP, one subgroup per layer, AllHost with clipping, jitted by the
  user with dos_jax.GPU_COMPILER_OPTIONS: at least L-1 of the L weight-gradient copies
  have a backward gemm issued while they are in flight."""
  num_layers, width = 6, 512
  params = probes.mlp_params(num_layers, width, jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, width)), jnp.bfloat16)
  offload = dos_jax.Offload(subgroup_size=width * width + width, policy=dos_jax.AllHost())
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(
      1e-3, offload=offload, implementation=dos_jax.Implementation(program='gpu')))
  dataflow.compile.prepare()
  state = opt.init(params)

  def step(p, s, x):
    loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  schedule = dataflow.compile_for_gpu(step, params, state, x, donate_argnums=(0, 1)).schedule
  weights = [c for c in schedule.gradient_copies() if c.nbytes == width * width * 2]
  assert len(weights) == num_layers, [c.nbytes for c in schedule.gradient_copies()]
  assert sum(c.gemms_between > 0 for c in weights) >= num_layers - 1


def test_the_runner_compiles_gpu_steps_with_the_scheduler_options():
  from dos_jax.train import step as step_lib
  assert step_lib.compiler_options_for('gpu') == dos_jax.GPU_COMPILER_OPTIONS
  assert step_lib.compiler_options_for('cpu') is None
  assert os.environ.get('JAX_PLATFORMS', 'cpu').startswith('cpu')
