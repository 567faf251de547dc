"""The two-memory program's step compiled for an H100 under each set of XLA options a
user may pass: XLA's defaults, the latency-hiding scheduler alone (what JAX's GPU
performance guide tells users to set, in `XLA_FLAGS` or `compiler_options`), and
`dos_jax.GPU_COMPILER_OPTIONS`.

Every set compiles, with no internal XLA error. A scheduling group is placed whole or
not at all: with the scheduler on and XLA's default limit on asynchronous calls in
flight (2), a group holding the host call and every stream lane stopped the compile
(`RET_CHECK ... latency_hiding_scheduler.cc:2567 ... Couldn't find an annotated node to
schedule`), so the group holds the host call and one lane fewer than the limit of the
options the step is compiled with (`dataflow.compile_for_gpu` and `dos_jax.jit` tell
the traced step; `lanes.grouped_lanes`), and a step runs in two lanes at most
(`lanes.MAX_LANES`).

What the step guarantees under `GPU_COMPILER_OPTIONS` (limit 3): every device update
runs beside a host call, and no streamed row's fetch waits for a write-back. Under the
scheduler alone (limit 2) the grouped lane runs beside the host call and the other lane
where the limit leaves room; under XLA's defaults (no latency-hiding scheduler, no
groups) the device update runs outside the host call.
"""

import pytest

from dos_jax import dataflow
from dos_jax.compiler_options import GPU_COMPILER_OPTIONS
from tests import compiled

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()



def offload_for(policy, subgroup_size: int):
  """The optimizer's `Offload` for these tests: nothing beyond the policy (the one
  construction, per subgroup, with its early host calls by the rule; the limit on
  asynchronous calls is that of the options `compile_for_gpu` compiles with). Built
  for the two-memory program (`Implementation(program='gpu')`)."""
  import dos_jax  # pylint: disable=import-outside-toplevel
  return dos_jax.Offload(subgroup_size=subgroup_size, policy=policy)


def _mlp_step(layers: int, width: int, dtype: str, policy):
  """A donated train step of an L x W MLP, one subgroup per layer, clipped (as
  `tests.tooling.probes.mlp_step`), its optimizer built with `offload_for`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import dos_jax  # pylint: disable=import-outside-toplevel
  from tests.tooling import probes  # pylint: disable=import-outside-toplevel

  params = jax.device_put(probes.mlp_params(layers, width, jnp.dtype(dtype)),
                          jax.devices()[0])
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, width)), jnp.dtype(dtype))
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(
      1e-3, offload=offload_for(policy, width * width + width),
      implementation=dos_jax.Implementation(program='gpu')))
  state = opt.init(params)

  def step(p, s, x):
    loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  return step, (params, state, x), {'donate_argnums': (0, 1)}


def _policy(name: str):
  import dos_jax  # pylint: disable=import-outside-toplevel
  return {'stride2': dos_jax.Stride(2), 'fraction': dos_jax.DeviceFraction(0.5),
          'stride2x3': dos_jax.Stride(2, buffers=3)}[name]


OPTIONS = {
    'xla_defaults': {},
    'lhs_alone': {'xla_gpu_enable_latency_hiding_scheduler': True},
    'gpu_compiler_options': dict(GPU_COMPILER_OPTIONS),
}

# (layers, width, dtype, policy): the two shapes issue 40 found failing, and more.
# Stride(2, buffers=3) would run 3 lanes, more than compiles under the scheduler alone
# (`lanes.MAX_LANES`).
FAMILY = (
    (8, 1024, 'bfloat16', 'stride2'),
    (10, 768, 'bfloat16', 'fraction'),
    (5, 512, 'float32', 'stride2x3'),
)


@pytest.mark.parametrize('options', list(OPTIONS))
@pytest.mark.parametrize('layers, width, dtype, policy', FAMILY, ids=lambda v: str(v))
def test_the_step_compiles_under_the_options_users_set(layers, width, dtype, policy,
                                                        options):
  fn, args, jit_kwargs = _mlp_step(layers, width, dtype, _policy(policy))
  ours = options == 'gpu_compiler_options'
  # Early host calls get a profiled latency (a second compile) only with our options.
  program = dataflow.compile_for_gpu(fn, *args, compiler_options=OPTIONS[options],
                                     early_windows=ours, **jit_kwargs)
  schedule = program.schedule
  assert schedule.host_calls, schedule.host_calls
  assert schedule.device_updates_on_streams() >= 1, schedule.stream_calls
  if ours:
    assert not schedule.device_updates_outside_host_calls(), (
        schedule.host_calls, schedule.stream_calls)
    assert schedule.streamed_rows and schedule.stream_prefetched(), schedule.streamed_rows
    assert schedule.stream_full_duplex(), schedule.streamed_rows
  elif options == 'lhs_alone':
    # The group: the host call beside the first lane, in every schedule.
    last = schedule.host_calls[-1]
    assert any(s.overlaps(last) for s in schedule.stream_calls), (
        last, schedule.stream_calls)


@pytest.mark.parametrize('options', ['xla_defaults', 'lhs_alone'])
def test_the_runners_step_with_early_calls_compiles_under_other_options(options):
  """The runner's step compiled with other options (`gpu_program.compile_step(cfg,
  compiler_options=...)`, `experiments/compile_gpu.py --default-schedule`) is built told
  their limit, and compiles, its early host calls' second compile (their profiled
  latency) included. Stride(2) with fp32 params: the H100 node's cost model gives it an
  early call. Built for the runner's limit (3), it stopped XLA (the RET_CHECK above)."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(None, ['offload.policy=stride', 'model.param_dtype=float32',
                               'offload.subgroup_size=65536', 'optim.clip_norm=1.0'])
  program = compiled.compile_step(cfg, compiler_options=OPTIONS[options])
  assert len(program.schedule.host_calls) >= 2, program.schedule.host_calls
  assert program.early_calls_profiled and program.compiles == 1, program.compiles
