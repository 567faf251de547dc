"""XLA's pinned-host pool cap (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`): the check refuses and
accepts as it should, `dos-jax train` sets it before any backend starts, `dos-jax plan`
prints it, and `init` on a GPU backend refuses a state the cap cannot hold, with one line.

The reference figures are elements x bytes counted by hand (bf16 params: fp32 master, m
and v, 12 B each element). On CPU the variable means nothing, so the GPU side of `init`
is forced with `on_gpu=True` or by monkeypatching the backend probe; that the 7B one-GPU
config then gets past `init` on a real H100 can only be shown on a GPU (`gpu` marker).
"""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import dos_jax
from dos_jax import pinned_pool
from dos_jax.planner import memory
from dos_jax.train import config

GIB = 2**30
VAR = pinned_pool.ENV_VAR


def test_limit_in_force_reads_xla_default_and_user_values():
  assert pinned_pool.limit_in_force({}) == (64, False)
  assert pinned_pool.limit_in_force({VAR: ' 200 '}) == (200, True)
  for bad in ('12.5', 'lots', '0', '-3'):
    with pytest.raises(pinned_pool.PinnedPoolError, match=VAR):
      pinned_pool.limit_in_force({VAR: bad})


def test_check_refuses_below_and_accepts_at_the_required_value():
  state = 76 * GIB  # The 7B model's fp32 Adam state on one GPU.
  need = math.ceil(76 * (1 + pinned_pool.MARGIN_FRACTION)) + pinned_pool.MARGIN_GIB
  assert pinned_pool.required_gib(state) == need == 82
  with pytest.raises(pinned_pool.PinnedPoolError) as err:
    pinned_pool.check_limit(state, 64, what='the state')
  message = str(err.value)
  assert '\n' not in message and f'{VAR}=64' in message and f'{VAR}={need}' in message
  with pytest.raises(pinned_pool.PinnedPoolError):
    pinned_pool.check_limit(state, need - 1, what='the state')
  pinned_pool.check_limit(state, need, what='the state')
  pinned_pool.check_limit(0.0, 1, what='nothing')


def test_set_default_sets_only_an_unset_variable_that_is_too_small():
  env = {}
  assert pinned_pool.set_default(100 * GIB, env) == 107 and env == {VAR: '107'}
  env = {}
  assert pinned_pool.set_default(10 * GIB, env) == 64 and env == {}
  env = {VAR: '8'}  # The user's value is kept; the runner refuses it on a GPU.
  assert pinned_pool.set_default(100 * GIB, env) == 8 and env == {VAR: '8'}


def _params(elements: int, leaves: int = 4):
  # Shapes only: the check runs before anything is allocated.
  return {f'w{i}': jax.ShapeDtypeStruct((elements // leaves,), jnp.bfloat16)
          for i in range(leaves)}


@pytest.mark.parametrize('policy, host_rows', [
    (dos_jax.AllHost(), 8), (dos_jax.Stride(2), 8), (dos_jax.AllDevice(), 0)])
def test_state_pinned_bytes_counts_the_host_tiers(policy, host_rows):
  offload = dos_jax.Offload(subgroup_size=1_000_000, policy=policy)
  got = pinned_pool.state_pinned_bytes(_params(8_000_000), offload)
  assert got == host_rows * 1_000_000 * 12
  got_bf16_mu = pinned_pool.state_pinned_bytes(_params(8_000_000), offload, mu_bytes=2)
  assert got_bf16_mu == host_rows * 1_000_000 * 10


def test_check_init_on_gpu_refuses_and_accepts_by_the_limit():
  params = _params(200_000_000)  # 200M bf16 params: 2.4e9 B = 2.24 GiB of state.
  offload = dos_jax.Offload(subgroup_size=50_000_000, policy=dos_jax.AllHost())
  need = math.ceil(2.4e9 * 1.05 / GIB) + 2
  with pytest.raises(pinned_pool.PinnedPoolError, match=f'{VAR}={need}'):
    pinned_pool.check_init(params, offload, on_gpu=True, environ={VAR: str(need - 1)})
  pinned_pool.check_init(params, offload, on_gpu=True, environ={VAR: str(need)})
  # Not on a GPU: the variable is not XLA's concern, nothing is checked.
  pinned_pool.check_init(params, offload, on_gpu=False, environ={VAR: '1'})
  # AllDevice pins nothing.
  pinned_pool.check_init(params, dos_jax.Offload(subgroup_size=50_000_000,
                                                 policy=dos_jax.AllDevice()),
                         on_gpu=True, environ={VAR: '1'})


def test_adamw_init_on_gpu_raises_before_allocating(monkeypatch):
  monkeypatch.setattr(pinned_pool, '_on_gpu', lambda params: True)
  monkeypatch.setenv(VAR, '1')
  tx = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=50_000_000,
                                                   policy=dos_jax.AllHost()))
  with pytest.raises(dos_jax.PinnedPoolError, match=f'{VAR}=1 is too small'):
    tx.init(_params(200_000_000))  # ShapeDtypeStructs: any allocation would fail first
  monkeypatch.setenv(VAR, '64')
  small = jax.device_put({'w': jnp.ones((1024,), jnp.float32)}, jax.devices()[0])
  dos_jax.adamw(1e-3).init(small)  # fits: init proceeds


def test_run_pinned_bytes_is_the_whole_state_per_process():
  sets = ['model.preset=7b', 'model.param_dtype=bfloat16', 'model.max_seq_len=2048',
          'data.seq_len=2048']
  cfg = config.load(None, sets + ['optim.clip_norm=null'])  # nothing speculates
  n = cfg.model.shape().num_params()
  assert memory.run_pinned_bytes(cfg) == n * (12 + 2 + 2)
  assert memory.run_pinned_bytes(cfg, processes=4) == n * 16 / 4
  assert memory.run_pinned_bytes(config.load(None, ['offload.policy=all_device'])) == 0
  # Early host calls under clipping (the default) may keep an undo of the state; the
  # one-memory program has none.
  assert memory.run_pinned_bytes(config.load(None, sets)) == n * (12 + 12 + 2 + 2)
  assert memory.run_pinned_bytes(config.load(None, sets + ['offload.platform=cpu'])) == (
      n * (12 + 2 + 2))


def test_plan_prints_the_pool_value():
  out = subprocess.run(
      [sys.executable, '-m', 'dos_jax.cli', 'plan', '--model', '7b', '--gpus-per-node', '1'],
      capture_output=True, text=True, check=False)
  n = dos_jax.model_shapes.preset('7b').num_params()
  assert f'{VAR}={pinned_pool.required_gib(n * 28)} per process' in out.stdout, out.stdout


@pytest.mark.gpu
def test_7b_one_gpu_init_gets_past_the_pool(tmp_path):
  """On a lent GPU: `dos-jax train configs/7b-1gpu.yaml` for one step sets the cap and
  gets past `init` (XLA's default 64 GiB would fail with an allocator error)."""
  out = subprocess.run(
      [sys.executable, '-m', 'dos_jax.cli', 'train', 'configs/7b-1gpu.yaml',
       '--set', 'train.steps=1', '--set', f'train.out_dir={tmp_path}/run',
       '--set', 'checkpoint.every=0'],
      capture_output=True, text=True, check=False, env={
          k: v for k, v in __import__('os').environ.items() if k != VAR})
  assert 'xla_gpu_host_bfc' not in out.stderr, out.stderr[-2000:]
  assert out.returncode == 0, out.stderr[-2000:]


def test_train_refuses_a_user_cap_too_small_on_gpu_only(monkeypatch):
  from dos_jax.train import cli  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv(VAR, '8')
  assert cli._pinned_shortfall(100 * GIB) is None  # CPU backend: not XLA:GPU's pool
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  line = cli._pinned_shortfall(100 * GIB)
  assert line.startswith(f'{VAR}=8 is too small') and f'{VAR}=107' in line
  monkeypatch.setenv(VAR, '107')
  assert cli._pinned_shortfall(100 * GIB) is None
