"""Checkpoints: exact round trip, keep-N, and a run killed mid-way resumes exactly."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dos_jax.train import checkpoint, config, data, trainer
from dos_jax.train.progress import read_metrics

# Two layers instead of four: the same code, compiled in half the time.
SMALL = [
    'model.n_layers=2',
    'data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=3', 'train.steps=24',
    'offload.subgroup_size=100000', 'train.eval_every=0', 'train.eval_batches=1',
]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=500_000, progress=False)
  return out


def _leaves_equal(a, b) -> bool:
  return all(
      np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


@pytest.mark.slow
def test_round_trip_is_exact_keeps_the_newest_and_crosses_layouts(dataset, tmp_path):
  """Save every step (keep 2), restore into a fresh run of the same config: bitwise equal,
  host state back in pinned_host; restore into a run with another policy and
  subgroup size: the same training continues (losses and params to 1e-6; fp32 compute,
  so a 1-ulp difference from the other fusion of the update is not amplified by bf16)."""
  base = [f'data.path={dataset}', *SMALL, 'model.compute_dtype=float32']
  cfg = config.load(None, [*base, 'offload.policy=stride'])
  run = trainer.build(cfg, devices=jax.devices()[:1])
  sampler = run.train_sampler()
  saver = checkpoint.Checkpointer(str(tmp_path / 'ckpt'), keep=2, async_save=True)
  for step in range(1, 4):
    run.step(next(sampler))
    saver.save(step, params=run.params, opt_state=run.opt_state,
               meta={'sampler': sampler.state()})
  saver.close()

  same = trainer.build(cfg, devices=jax.devices()[:1])
  other = trainer.build(
      config.load(None, [*base, 'offload.policy=all_host', 'offload.subgroup_size=70000']),
      devices=jax.devices()[:1],
  )
  assert other.opt_state.layout != run.opt_state.layout
  loader = checkpoint.Checkpointer(str(tmp_path / 'ckpt'), keep=2, async_save=True)
  assert loader.all_steps() == [2, 3]
  restored = loader.restore(3, params=same.params, opt_state=same.opt_state, tx=same.tx)
  crossed = loader.restore(3, params=other.params, opt_state=other.opt_state, tx=other.tx)
  loader.close()
  assert restored.meta == {'sampler': sampler.state()}
  assert _leaves_equal(restored.params, run.params)
  assert _leaves_equal(restored.opt_state, run.opt_state)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state)
           if x.ndim >= 2 and x.size}
  assert kinds == {'pinned_host'}
  same.set_state(restored.params, restored.opt_state)
  other.set_state(crossed.params, crossed.opt_state)
  for _ in range(2):
    batch = next(sampler)
    expected = run.step(batch).loss
    assert same.step(batch).loss == expected
    np.testing.assert_allclose(other.step(batch).loss, expected, rtol=1e-6)
  assert _leaves_equal(same.params, run.params)
  for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(other.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def _train_cmd(dataset, out_dir, *extra):
  sets = [f'data.path={dataset}', *SMALL, 'offload.policy=stride', 'checkpoint.every=4',
          'checkpoint.keep=10', 'train.log_every=1', f'train.out_dir={out_dir}', *extra]
  cmd = [sys.executable, '-m', 'dos_jax.cli', 'train']
  for item in sets:
    cmd += ['--set', item]
  return cmd


def _env(cache_dir):
  env = dict(os.environ)
  # One CPU device in every child, so all runs execute the very same programs.
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
  env['JAX_PLATFORMS'] = 'cpu'
  # Children after the first load compiled programs from disk (~3x faster start).
  env['JAX_COMPILATION_CACHE_DIR'] = str(cache_dir)
  env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  return env


def _wait_for(proc, predicate, what, timeout=120.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    if proc.poll() is not None:
      raise AssertionError(f'run ended (rc={proc.returncode}) before {what}: '
                           f'{proc.stderr.read()[-2000:]}')
    time.sleep(0.02)
  proc.kill()
  raise AssertionError(f'timed out waiting for {what}')


def _steps_logged(metrics_path) -> list[int]:
  if not os.path.exists(metrics_path):
    return []
  return [r['step'] for r in read_metrics(metrics_path) if 'loss' in r]


def _final_params(run_dir, dataset):
  cfg = config.load(None, [f'data.path={dataset}', *SMALL, 'offload.policy=stride'])
  fresh = trainer.build(cfg, devices=jax.devices()[:1])
  loader = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'), keep=10,
                                   async_save=False)
  assert loader.latest_step() == 24
  restored = loader.restore(24, params=fresh.params, opt_state=fresh.opt_state, tx=fresh.tx)
  loader.close()
  return restored


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(dataset, tmp_path):
  """A run SIGKILLed mid-way (possibly mid-save), resumed, then stopped by Ctrl-C and
  resumed again ends with exactly the params and state of an uninterrupted run."""
  straight, broken = str(tmp_path / 'straight'), str(tmp_path / 'broken')
  done = subprocess.run(_train_cmd(dataset, straight), env=_env(tmp_path / 'jax_cache'), capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'finished step 24' in done.stderr

  ckpt_dir = os.path.join(broken, 'checkpoints')
  proc = subprocess.Popen(_train_cmd(dataset, broken), env=_env(tmp_path / 'jax_cache'), stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, text=True)

  def saving_after_step_4():
    # Kill while a checkpoint past step 4 is being written, if we catch one.
    if not os.path.isdir(ckpt_dir):
      return False
    names = os.listdir(ckpt_dir)
    return ('4' in names and any('tmp' in n for n in names)) or '12' in names

  _wait_for(proc, saving_after_step_4, 'a checkpoint after step 4')
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  at_kill = sorted(os.listdir(ckpt_dir))
  print('checkpoint directory when killed:', at_kill)
  proc.stderr.close()
  assert proc.returncode == -signal.SIGKILL
  assert max(_steps_logged(os.path.join(broken, 'metrics.jsonl'))) < 24
  # Whatever the kill interrupted, every checkpoint orbax lists is complete.
  survivor = checkpoint.Checkpointer(ckpt_dir, keep=10, async_save=False)
  listed = survivor.all_steps()
  survivor.close()
  assert listed and max(listed) < 24
  # A save the kill cut short (usually caught: '8.orbax-checkpoint-tmp') is not listed.
  for name in at_kill:
    if 'tmp' in name:
      assert int(name.split('.')[0]) not in listed, (name, listed)
  assert all(os.path.exists(os.path.join(ckpt_dir, str(s), 'commit_success.txt'))
             or os.path.exists(os.path.join(ckpt_dir, str(s), '_CHECKPOINT_METADATA'))
             for s in listed)

  # Resume, and this time stop it with Ctrl-C: it saves where it stopped, exits 130.
  proc = subprocess.Popen(_train_cmd(dataset, broken), env=_env(tmp_path / 'jax_cache'), stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, text=True)
  metrics = os.path.join(broken, 'metrics.jsonl')
  logged_before = len(_steps_logged(metrics))
  _wait_for(proc, lambda: len(_steps_logged(metrics)) >= logged_before + 2,
            'two steps after resuming')
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert f'resumed from {ckpt_dir} at step {max(listed)}' in err
  assert 'interrupted at step' in err
  stopped_at = int(err.split('interrupted at step ')[1].split()[0])
  assert stopped_at < 24 and str(stopped_at) in os.listdir(ckpt_dir)
  assert not any('tmp' in n for n in os.listdir(ckpt_dir))  # Leftovers were cleaned up.

  resumed = subprocess.run(_train_cmd(dataset, broken), env=_env(tmp_path / 'jax_cache'), capture_output=True,
                           text=True, timeout=300, check=False)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f'at step {stopped_at}' in resumed.stderr

  a, b = _final_params(straight, dataset), _final_params(broken, dataset)
  assert _leaves_equal(a.params, b.params)
  assert _leaves_equal(a.opt_state, b.opt_state)
  assert a.meta == b.meta
