"""The one-line warnings of a step traced for a GPU whose schedule would be serial, or
whose jax's schedule of the construction the compiled tests have not read
(`compiler_options.warn_where_serial`), or whose staged lowering leaves streamed rows
beside no host work (`compiler_options.warn_rows_beside_no_host_work`)."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax import compiler_options


def _trace(jitter=jax.jit):
  params = jax.device_put({'w': jnp.ones((4, 8)), 'b': jnp.ones(8)}, jax.devices()[0])
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=8, policy=dos_jax.Stride(2)),
                      implementation=dos_jax.Implementation(program='gpu'))
  state = opt.init(params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):  # traced twice: warned once
      jitter(opt.update).trace(params, state, params)
  # The staged lowering's line on streamed rows beside no host work has its own test.
  return [str(w.message) for w in caught if str(w.message).startswith('dos_jax:')
          and 'beside no host work' not in str(w.message)]


@pytest.fixture(name='on_gpu')
def _on_gpu(monkeypatch):
  """The step traced as on a GPU backend, with no warning given yet in this process."""
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(compiler_options, '_warned', set())
  monkeypatch.setenv('XLA_FLAGS', '')


def test_a_plain_jit_on_a_gpu_is_told_once_what_runs_serially(on_gpu):
  del on_gpu
  messages = _trace()
  assert len(messages) == 1, messages
  assert 'latency-hiding scheduler' in messages[0] and 'dos_jax.jit' in messages[0]
  assert 'xla_gpu_enable_latency_hiding_scheduler=true' in messages[0]


@pytest.mark.parametrize('where', ['xla_flags', 'dos_jax_jit'])
def test_no_warning_where_the_scheduler_is_said_to_be_on(on_gpu, where, monkeypatch):
  del on_gpu
  if where == 'xla_flags':
    monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_enable_latency_hiding_scheduler=true')
    assert _trace() == []
  else:
    assert _trace(dos_jax.jit) == []


def test_an_unchecked_jax_is_named_once(on_gpu, monkeypatch):
  del on_gpu
  monkeypatch.setattr(lowering_lib, 'checked', lambda version=None: False)
  messages = _trace(dos_jax.jit)
  assert len(messages) == 1 and f'jax {jax.__version__}' in messages[0], messages
  assert "inside a host call's window" in messages[0]


def test_nothing_is_said_on_a_cpu(monkeypatch):
  monkeypatch.setattr(compiler_options, '_warned', set())
  monkeypatch.setenv('XLA_FLAGS', '')
  assert jax.default_backend() == 'cpu'
  assert _trace() == []


@pytest.mark.parametrize('host', [dos_jax.UpdateImpl.XLA, dos_jax.UpdateImpl.KERNEL])
def test_streamed_rows_beside_no_host_work_are_named_once(on_gpu, monkeypatch, host):
  """The staged lowering (jax 0.12) runs one streamed row per lane beside each host
  region: with 6 streamed subgroups on one lane (a plain jit: XLA's limit of 2) and 2
  host subgroups in XLA's one host region, rows are left after the last stage, and the
  step says how many, once. The native kernel splits its subgroups by columns into a
  host region per row (`Construction.host_columns`): nothing is said."""
  del on_gpu
  monkeypatch.setattr(lowering_lib, 'of_version',
                      lambda version=None: lowering_lib.Lowering.STAGED)
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_enable_latency_hiding_scheduler=true')
  params = jax.device_put({f'w{i}': jnp.ones(2048) for i in range(8)}, jax.devices()[0])
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=2048,
                                                    policy=dos_jax.DeviceFraction(0.75)),
                      implementation=dos_jax.Implementation(program='gpu', host=host))
  state = opt.init(params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):
      jax.jit(opt.update).trace(params, state, params)
  messages = [str(w.message) for w in caught if 'beside no host work' in str(w.message)]
  if host is dos_jax.UpdateImpl.KERNEL:
    assert not messages, messages
    return
  assert len(messages) == 1, [str(w.message) for w in caught]
  rows, regions, per_lane = map(int, re.match(
      r'dos_jax: (\d+) streamed rows run after .* has (\d+) host regions .* for (\d+) '
      r'streamed rows per lane', messages[0]).groups())
  # One lane holds every streamed row; each stage takes one beside a host region.
  assert per_lane == 6 and 1 <= regions < per_lane and rows == per_lane - regions, messages
