"""The runner never loses work: non-finite steps, damaged checkpoints, unsafe resumes.

Each test breaks a run on purpose (a diverging learning rate, a flipped bit, a changed
batch size, SIGTERM, a failure at the first step) and checks what is left on disk and
what the command says, through `dos-jax train` itself.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dos_jax import cli
from dos_jax.train import checkpoint, config, data, integrity, trainer
from dos_jax.train.progress import read_metrics

# Two layers, short windows: the same code, compiled in a few seconds.
SMALL = ['model.n_layers=2', 'data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=0',
         'optim.schedule=constant', 'train.eval_every=0', 'train.eval_batches=1',
         'train.log_every=1', 'offload.subgroup_size=100000', 'train.split_every=0']


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=200_000, progress=False)
  return out


def _args(dataset, out_dir, *extra):
  args = ['train']
  for item in [f'data.path={dataset}', *SMALL, f'train.out_dir={out_dir}', *extra]:
    args += ['--set', item]
  return args


def _error_lines(capsys) -> list[str]:
  err = capsys.readouterr().err
  assert 'Traceback' not in err
  return [line for line in err.splitlines() if line.startswith('dos-jax: error:')]


def _restore_newest(ckpt_dir, dataset):
  cfg = config.load(None, [f'data.path={dataset}', *SMALL])
  fresh = trainer.build(cfg, devices=jax.devices()[:1])
  saver = checkpoint.Checkpointer(str(ckpt_dir), keep=10, async_save=False)
  step = saver.latest_step()
  restored = saver.restore(step, params=fresh.params, opt_state=fresh.opt_state, tx=fresh.tx)
  saver.close()
  return step, restored


def _all_finite(tree) -> bool:
  return all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_diverging_run_exits_1_names_the_step_and_keeps_the_finite_checkpoint(
    dataset, tmp_path, capsys
):
  """A learning rate of 1e30 turns params and gradients non-finite within a step or two.
  With `checkpoint.every=1` and `keep=1`, the old runner saved the NaN state and rotation
  deleted the finite one; now the run stops at the bad step with exit 1 and one line
  naming it, and the checkpoint left (after two re-runs too) is the finite one."""
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=2', 'checkpoint.keep=1')) == 0
  capsys.readouterr()
  for _ in range(2):
    code = cli.main(_args(dataset, out, 'train.steps=12', 'optim.lr=1e30',
                          'checkpoint.every=1', 'checkpoint.keep=1'))
    assert code == 1
    err = capsys.readouterr().err
    bad = [line for line in err.splitlines() if 'not finite' in line]
    assert len(bad) == 1 and bad[0].startswith('dos-jax: error: step '), err
    bad_step = int(bad[0].split()[3].rstrip(':'))
    assert bad_step >= 3
    step, restored = _restore_newest(out / 'checkpoints', dataset)
    assert step == bad_step - 1  # Every finite step before the bad one was saved.
    assert _all_finite(restored.params) and _all_finite(restored.opt_state)
    assert sorted(os.listdir(out / 'checkpoints')) == [str(step)]
  records = read_metrics(str(out / 'metrics.jsonl'))
  assert records[-1]['summary'] and records[-1]['nonfinite_step'] == bad_step


def test_saving_non_finite_params_is_refused_and_writes_nothing(dataset, tmp_path):
  cfg = config.load(None, [f'data.path={dataset}', *SMALL])
  run = trainer.build(cfg, devices=jax.devices()[:1])
  bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan) if x.ndim else x, run.params)
  saver = checkpoint.Checkpointer(str(tmp_path / 'ckpt'), keep=2, async_save=True)
  with pytest.raises(checkpoint.NonFiniteState, match='step 7'):
    saver.save(7, params=bad, opt_state=run.opt_state, meta={})
  saver.close()
  assert not os.listdir(tmp_path / 'ckpt')


def _write_dataset(path, train, val, vocab_size=256):
  os.makedirs(path)
  np.asarray(train, np.uint16).tofile(os.path.join(path, 'train.bin'))
  np.asarray(val, np.uint16).tofile(os.path.join(path, 'val.bin'))
  meta = data.DatasetMeta(
      vocab_size=vocab_size, dtype='uint16', train_tokens=len(train), val_tokens=len(val),
      tokenizer='bytes', tokenizer_sha256=None, sources=('test',), num_files=1,
      skipped_files=0, input_bytes=len(train) + len(val), val_fraction=0.1, max_bytes=None)
  with open(os.path.join(path, 'meta.json'), 'w', encoding='utf-8') as f:
    f.write(meta.to_json())


@pytest.mark.parametrize('where, vocab_size, culprit', [
    ('train', 256, 'train.bin holds token id 300'),
    ('val', 256, 'val.bin holds token id 300'),
    (None, 512, 'model.vocab_size: 256 is smaller than the vocabulary of the dataset (512'),
])
def test_out_of_range_token_ids_are_refused_at_load(tmp_path, capsys, where, vocab_size,
                                                    culprit, seed):
  rng = np.random.default_rng(seed)
  train, val = rng.integers(0, 256, 5000), rng.integers(0, 256, 500)
  if where is not None:
    (train if where == 'train' else val)[rng.integers(0, 500)] = 300
  path = str(tmp_path / 'tokens')
  _write_dataset(path, train, val, vocab_size)
  out = tmp_path / 'run'
  assert cli.main(_args(path, out, 'train.steps=2')) == 2
  lines = _error_lines(capsys)
  assert len(lines) == 1 and culprit in lines[0], lines
  assert not out.exists()


def _flip_a_bit(step_dir, rng):
  # pylint: disable-next=protected-access
  files = sorted(p for p in integrity._files(str(step_dir)) if '/d/' in p)
  target = os.path.join(step_dir, files[rng.integers(len(files))])
  raw = bytearray(open(target, 'rb').read())
  raw[rng.integers(len(raw))] ^= 1 << int(rng.integers(8))
  open(target, 'wb').write(bytes(raw))


@pytest.mark.parametrize('damage', ['flipped_bit', 'truncated', 'no_manifest'])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    dataset, tmp_path, capsys, damage, seed
):
  """Checkpoints at 3 and 6; the one at 6 is damaged. Resuming says so in one line,
  moves it aside, resumes from 3 and replays steps 4-6 with the same losses; the
  metrics file holds each step once, with a marker where it resumed."""
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=6', 'checkpoint.every=3')) == 0
  first = {r['step']: r['loss'] for r in read_metrics(str(out / 'metrics.jsonl')) if 'loss' in r}
  newest = out / 'checkpoints' / '6'
  if damage == 'flipped_bit':
    _flip_a_bit(newest, np.random.default_rng(seed))
  elif damage == 'truncated':
    biggest = max(integrity._files(str(newest)),  # pylint: disable=protected-access
                  key=lambda p: os.path.getsize(newest / p))
    os.truncate(newest / biggest, os.path.getsize(newest / biggest) // 2)
  else:
    os.unlink(newest / integrity.MANIFEST)
  capsys.readouterr()
  assert cli.main(_args(dataset, out, 'train.steps=7', 'checkpoint.every=3')) == 0
  err = capsys.readouterr().err
  notes = [line for line in err.splitlines() if line.startswith('checkpoint 6 is ')]
  assert len(notes) == 1, err
  assert ('corrupt' if damage != 'no_manifest' else 'incomplete') in notes[0]
  assert 'resuming from step 3' in notes[0]
  assert 'resumed from' in err and 'at step 3' in err
  records = read_metrics(str(out / 'metrics.jsonl'))
  steps = [r['step'] for r in records if 'loss' in r]
  assert steps == [1, 2, 3, 4, 5, 6, 7]
  assert [r.get('resumed_from') for r in records if 'resumed_from' in r] == [3]
  again = {r['step']: r['loss'] for r in records if 'loss' in r}
  for step in (4, 5, 6):
    assert again[step] == first[step]
  assert os.path.isdir(out / 'checkpoints' / '6.damaged')
  assert sorted(os.listdir(out / 'checkpoints')) == ['3', '6', '6.damaged', '7']
  for step in (3, 6, 7):
    integrity.verify(str(out / 'checkpoints' / str(step)))


def test_each_checkpoint_file_is_in_its_manifest(dataset, tmp_path):
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=2')) == 0
  step_dir = out / 'checkpoints' / '2'
  manifest = json.loads((step_dir / integrity.MANIFEST).read_text())
  on_disk = {os.path.relpath(os.path.join(r, f), step_dir)
             for r, _, fs in os.walk(step_dir) for f in fs} - {integrity.MANIFEST}
  assert set(manifest['files']) == on_disk and len(on_disk) > 5
  for rel, entry in manifest['files'].items():
    assert entry['sha256'] == integrity.file_sha256(str(step_dir / rel))
  assert manifest['run']['data.batch_size'] == 8


@pytest.mark.parametrize('change', [
    'data.batch_size=16', 'data.seq_len=16', 'data.seed=1', 'model.dim=64', 'model.n_layers=3',
    'data.path=OTHER',
])
def test_resume_that_changes_model_or_stream_refuses_before_writing(
    dataset, tmp_path, capsys, change
):
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=2')) == 0
  before = {p: open(os.path.join(r, p), 'rb').read()
            for r, _, fs in os.walk(out) for p in fs}
  if change == 'data.path=OTHER':
    other = str(tmp_path / 'other')
    data.prepare(None, other, val_fraction=0.05, max_bytes=150_000, progress=False)
    change = f'data.path={other}'
  capsys.readouterr()
  assert cli.main(_args(dataset, out, 'train.steps=4', change)) == 2
  lines = _error_lines(capsys)
  key = change.split('=')[0]
  assert len(lines) == 1 and f'--set {change}: {key}: ' in lines[0], lines
  assert 'checkpoint being resumed' in lines[0]
  after = {p: open(os.path.join(r, p), 'rb').read() for r, _, fs in os.walk(out) for p in fs}
  assert after == before


def test_rerunning_a_finished_run_writes_nothing(dataset, tmp_path, capsys):
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=2')) == 0
  text = (out / 'metrics.jsonl').read_text()
  capsys.readouterr()
  assert cli.main(_args(dataset, out, 'train.steps=2')) == 0
  assert 'nothing to do: the run is already at step 2' in capsys.readouterr().err
  assert (out / 'metrics.jsonl').read_text() == text


def test_failure_before_the_first_checkpoint_leaves_nothing(dataset, tmp_path, capsys,
                                                            monkeypatch):
  """As `model.preset=7b` running out of memory at its first step: one line, exit 1, and
  no half-made run folder."""

  def out_of_memory(*args, **kwargs):
    raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 15.4GiB.')

  monkeypatch.setattr(trainer.Trainer, 'step', out_of_memory)
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=2')) == 1
  lines = _error_lines(capsys)
  assert len(lines) == 1 and 'out of memory' in lines[0]
  assert not out.exists()


def _env():
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
  env['JAX_PLATFORMS'] = 'cpu'
  return env


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143(dataset, tmp_path):
  out = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'dos_jax.cli', *_args(dataset, out, 'train.steps=100000',
                                                      'checkpoint.every=0')]
  proc = subprocess.Popen(cmd, env=_env(), stderr=subprocess.PIPE, text=True)
  metrics = out / 'metrics.jsonl'
  deadline = time.monotonic() + 180
  while time.monotonic() < deadline and proc.poll() is None:
    if metrics.exists() and sum(1 for r in read_metrics(str(metrics)) if 'loss' in r) >= 3:
      break
    time.sleep(0.05)
  assert proc.poll() is None, proc.stderr.read()
  proc.send_signal(signal.SIGTERM)
  err = proc.communicate(timeout=120)[1]
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert 'interrupted at step' in err
  last = max(r['step'] for r in read_metrics(str(metrics)) if 'loss' in r)
  assert os.listdir(out / 'checkpoints') == [str(last)]
  integrity.verify(str(out / 'checkpoints' / str(last)))


def test_checkpoints_without_any_manifest_resume_unverified_with_a_warning(
    dataset, tmp_path, capsys
):
  """A run directory written before checksums existed: the newest checkpoint is
  restored (not silently replaced by a fresh start), and the run says it is unverified."""
  out = tmp_path / 'run'
  assert cli.main(_args(dataset, out, 'train.steps=4', 'checkpoint.every=2')) == 0
  first = {r['step']: r['loss'] for r in read_metrics(str(out / 'metrics.jsonl')) if 'loss' in r}
  for step in (2, 4):
    os.unlink(out / 'checkpoints' / str(step) / integrity.MANIFEST)
  capsys.readouterr()
  assert cli.main(_args(dataset, out, 'train.steps=5', 'checkpoint.every=2')) == 0
  err = capsys.readouterr().err
  assert 'checkpoint 4 has no checksum manifest' in err and 'at step 4' in err
  records = read_metrics(str(out / 'metrics.jsonl'))
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4, 5]
  assert {r['step']: r['loss'] for r in records if 'loss' in r and r['step'] <= 4} == first
  # Once a verified checkpoint exists, rotation removes the unverified older ones.
  assert sorted(os.listdir(out / 'checkpoints')) == ['5']


def test_a_dataset_rewritten_in_place_is_refused_on_resume(tmp_path, capsys):
  path = str(tmp_path / 'tokens')
  data.prepare(None, path, val_fraction=0.05, max_bytes=120_000, progress=False)
  out = tmp_path / 'run'
  assert cli.main(_args(path, out, 'train.steps=2')) == 0
  data.prepare(None, path, val_fraction=0.05, max_bytes=130_000, progress=False)
  capsys.readouterr()
  assert cli.main(_args(path, out, 'train.steps=4')) == 2
  lines = _error_lines(capsys)
  assert len(lines) == 1 and 'has 123500 train tokens, but 114000 when the checkpoint' in lines[0]
