"""Steps with more streamed rows per lane than host subgroups, compiled for an H100:
every device update inside a host call's window on every supported jax and under both
option sets a user passes (`GPU_COMPILER_OPTIONS`, the latency-hiding scheduler alone
with XLA's limit of 2). On jax 0.12 (the staged lowering: a host region per stage) the
native kernel's host subgroups are split by columns into a host region per streamed row
(`Construction.host_columns`); before, the rows beyond the host subgroups ran after
the last host call (RESULTS.md, "Host regions by columns"). No host->host copy of the
state either way.
"""

import pytest

import dos_jax
from dos_jax import dataflow
from tests import compiled
from tests.tooling import probes

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

# (layers, width, dtype, policy): 6 streamed of 8 (one lane under the scheduler alone:
# 6 rows beside 2 host subgroups), 11 of 12 (one host subgroup), 6 of 10.
CASES = ((8, 512, 'bfloat16', dos_jax.DeviceFraction(0.75)),
         (12, 512, 'bfloat16', dos_jax.DeviceFraction(0.9)),
         (10, 256, 'bfloat16', dos_jax.DeviceFraction(0.6)))
OPTIONS = {'project': None, 'scheduler_alone': {'xla_gpu_enable_latency_hiding_scheduler': True}}


@pytest.mark.parametrize('options', sorted(OPTIONS))
@pytest.mark.parametrize('layers, width, dtype, policy', CASES, ids=lambda v: str(v))
def test_every_streamed_row_runs_beside_a_host_call(layers, width, dtype, policy, options):
  fn, args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype, policy=policy)
  given = OPTIONS[options]
  program = dataflow.compile_for_gpu(
      fn, *args, **({} if given is None else {'compiler_options': given}), **jit_kwargs)
  schedule = program.schedule
  assert schedule.stream_calls, schedule.stream_calls
  assert not schedule.device_updates_outside_host_calls(), (schedule.host_calls,
                                                            schedule.stream_calls)
  assert not schedule.large_host_copies(), schedule.host_copies
