"""`train.compilation_cache`: a second run of the same config loads the first run's
compiled programs from `<dos_jax cache>/jax` instead of compiling them."""

import os
import subprocess
import sys

import pytest

from dos_jax.train import data
from dos_jax.train.progress import read_metrics

SETS = ['model.n_layers=2', 'data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=1',
        'train.steps=3', 'train.eval_batches=1', 'train.log_every=1', 'checkpoint.every=0',
        'checkpoint.async_save=false']


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=300_000, progress=False)
  return out


def _train(dataset, out_dir, cache_root):
  # No cache set for JAX (the suite's is removed): the runner's own, under cache_root.
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_PERSISTENT_CACHE')
         and k != 'JAX_COMPILATION_CACHE_DIR'}
  env.update(DOS_JAX_CACHE_DIR=str(cache_root), JAX_PLATFORMS='cpu')
  cmd = [sys.executable, '-m', 'dos_jax.cli', 'train']
  for item in [f'data.path={dataset}', *SETS, f'train.out_dir={out_dir}']:
    cmd += ['--set', item]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'Error reading persistent compilation cache' not in done.stderr
  return [r['loss'] for r in read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
          if 'loss' in r]


def _entries(folder):
  return sorted(n for n in os.listdir(folder) if not n.endswith('-atime'))


@pytest.mark.slow
def test_a_second_run_loads_every_program_the_first_compiled(dataset, tmp_path):
  first = _train(dataset, tmp_path / 'run1', tmp_path / 'cache')
  folder = tmp_path / 'cache' / 'jax'
  stored = _entries(folder)
  # The step, the evaluation and the small programs around them (init, checkpointing).
  assert len(stored) >= 3, stored
  second = _train(dataset, tmp_path / 'run2', tmp_path / 'cache')
  assert _entries(folder) == stored  # nothing compiled anew: every program was loaded
  assert second == first  # the loaded programs compute what the compiled ones did
