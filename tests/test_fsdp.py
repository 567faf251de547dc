"""ZeRO-3 over the `fsdp` mesh axis, on CPU devices: the same training as one device and
as data parallelism, each device holding its quarter, checkpoints that cross meshes.

The reference is the one-device run of the same config (fp32 compute, so that only the
order of reductions differs). Tolerances: losses and gradient norms to 1e-4 relative over
20 steps, params to 1e-4 absolute (fp32 reductions in another order, compounded over 20
AdamW steps; seen when written: losses within 1e-7 relative over the first 5 steps).
The batches are the dataset sampler's (seeded by `data.seed`), the params `train.seed`'s.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dos_jax.train import config, data, loop, trainer
from dos_jax.train.progress import read_metrics

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices')

SMALL = [
    'model.n_layers=2', 'model.compute_dtype=float32', 'data.seq_len=32', 'data.batch_size=8',
    'optim.warmup_steps=5', 'optim.lr=3e-3', 'train.steps=20', 'train.eval_every=0',
    'train.eval_batches=1', 'offload.subgroup_size=100000',
]
STEPS = 20


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=500_000, progress=False)
  return out


def _cfg(dataset, *overrides):
  return config.load(None, [f'data.path={dataset}', *SMALL, *overrides])


@pytest.mark.slow
@pytest.mark.parametrize('policy', ['all_host', 'stride', 'auto'])
def test_fsdp4_and_data4_match_one_device_over_20_steps(dataset, policy, tmp_path,
                                                       monkeypatch):
  monkeypatch.setenv('DOS_JAX_CACHE_DIR', str(tmp_path / 'profile'))  # Auto calibrates here
  runs = {
      'one': trainer.build(_cfg(dataset, f'offload.policy={policy}', 'mesh.data=1'),
                           devices=jax.devices()[:1]),
      'data4': trainer.build(_cfg(dataset, f'offload.policy={policy}', 'mesh.data=4'),
                             devices=jax.devices()[:4]),
      'fsdp4': trainer.build(_cfg(dataset, f'offload.policy={policy}', 'mesh.data=1',
                                  'mesh.fsdp=4'), devices=jax.devices()[:4]),
  }
  assert dict(runs['fsdp4'].mesh.shape) == {'data': 1, 'fsdp': 4, 'tensor': 1, 'pipeline': 1}
  sampler = runs['one'].train_sampler()
  losses = {name: [] for name in runs}
  for _ in range(STEPS):
    batch = next(sampler)
    results = {name: run.step(batch) for name, run in runs.items()}
    for name, result in results.items():
      losses[name].append(result.loss)
    for name in ('data4', 'fsdp4'):
      np.testing.assert_allclose(results[name].loss, results['one'].loss, rtol=1e-4)
      np.testing.assert_allclose(results[name].grad_norm, results['one'].grad_norm, rtol=1e-4)
  assert losses['one'][-1] < losses['one'][0] - 0.5  # it trains
  for name in ('data4', 'fsdp4'):
    for x, y in zip(jax.tree.leaves(runs['one'].params), jax.tree.leaves(runs[name].params)):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-4)
  assert runs['fsdp4'].compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}


def test_each_device_holds_a_quarter_of_every_sharded_param_and_of_the_state(dataset):
  run = trainer.build(_cfg(dataset, 'offload.policy=stride', 'mesh.data=1', 'mesh.fsdp=4'),
                      devices=jax.devices()[:4])
  sharded = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(run.params):
    spec = leaf.sharding.spec
    if 'fsdp' not in spec:
      assert leaf.ndim == 1, jax.tree_util.keystr(path)  # only the norm scales stay whole
      continue
    sharded += 1
    dim = list(spec).index('fsdp')
    want = tuple(n // 4 if i == dim else n for i, n in enumerate(leaf.shape))
    shards = leaf.addressable_shards
    assert len(shards) == 4 and {s.data.shape for s in shards} == {want}
    assert len({str(s.index) for s in shards}) == 4  # four different quarters
  assert sharded == 2 + 7 * 2  # embedding, head, and 7 matrices per block
  rows = [x for x in jax.tree.leaves(run.opt_state) if getattr(x, 'ndim', 0) == 3 and x.size]
  assert rows
  for leaf in rows:
    assert leaf.sharding.memory_kind == 'pinned_host'
    assert {s.data.shape[-1] for s in leaf.addressable_shards} == {leaf.shape[-1] // 4}


def test_fsdp2_times_tensor2_matches_one_device(dataset):
  one = trainer.build(_cfg(dataset, 'mesh.data=1'), devices=jax.devices()[:1])
  both = trainer.build(_cfg(dataset, 'mesh.data=1', 'mesh.fsdp=2', 'mesh.tensor=2'),
                       devices=jax.devices()[:4])
  wq = both.params['blocks']['0']['attn']['wq']
  assert wq.sharding.spec == P('fsdp', 'tensor', None)
  sampler = one.train_sampler()
  for _ in range(6):
    batch = next(sampler)
    np.testing.assert_allclose(both.step(batch).loss, one.step(batch).loss, rtol=1e-4)


def _metrics(out_dir):
  return {r['step']: r['loss'] for r in read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
          if 'loss' in r}


@pytest.mark.slow
def test_a_checkpoint_saved_under_fsdp4_resumes_under_data2_and_on_one_device(dataset, tmp_path):
  common = ['offload.policy=stride', 'checkpoint.every=4', 'checkpoint.async_save=false',
            'train.log_every=1']
  ref_dir = str(tmp_path / 'ref')
  loop.train(_cfg(dataset, *common, 'train.steps=8', 'mesh.data=1', 'mesh.fsdp=4',
                  f'train.out_dir={ref_dir}'), devices=jax.devices()[:4])
  expected = _metrics(ref_dir)
  for name, mesh, devices in (('data2', ['mesh.data=2'], 2), ('one', ['mesh.data=1'], 1)):
    out_dir = str(tmp_path / name)
    # The first 4 steps under fsdp=4, then resumed from their checkpoint on another mesh.
    loop.train(_cfg(dataset, *common, 'train.steps=4', 'mesh.data=1', 'mesh.fsdp=4',
                    f'train.out_dir={out_dir}'), devices=jax.devices()[:4])
    summary = loop.train(_cfg(dataset, *common, 'train.steps=8', *mesh,
                              f'train.out_dir={out_dir}'), devices=jax.devices()[:devices])
    assert summary.final_step == 8
    got = _metrics(out_dir)
    for step in range(5, 9):
      np.testing.assert_allclose(got[step], expected[step], rtol=1e-4)


@pytest.mark.slow
def test_bad_fsdp_meshes_exit_2_with_one_line(tmp_path):
  """Each bad mesh is one line and exit 2, before anything is written: not the run
  folder, and not the default corpus, which a first run prepares into an empty cache
  (given here, so the line is checked as on a fresh machine)."""
  cache = tmp_path / 'cache'
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu', DOS_JAX_CACHE_DIR=str(cache))
  cases = [(['mesh.fsdp=2', 'mesh.pipeline=2'], 'mesh.fsdp'),
           (['mesh.fsdp=3'], 'does not divide the 4 available device(s)'),
           (['mesh.fsdp=4', 'mesh.data=1', 'data.batch_size=6'], 'data.batch_size')]
  for sets, culprit in cases:
    cmd = [sys.executable, '-m', 'dos_jax.cli', 'train', '--set',
           f'train.out_dir={tmp_path}/run']
    for item in sets:
      cmd += ['--set', item]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and culprit in lines[0], out.stderr
    assert not (tmp_path / 'run').exists()
    assert not (cache / 'data').exists(), sorted(cache.rglob('*'))
