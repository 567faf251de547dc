"""A new user's first commands: prepare a small folder, train, make the usual mistakes.

Each mistake must end in one line naming the culprit (the `--set` argument, the key,
the file) with exit code 2 and nothing written.
"""

import io
import os
import stat

import numpy as np
import pytest

from dos_jax import cache, cli
from dos_jax.train import config, data
from dos_jax.train.progress import Progress
from tests.test_cli import _sets

SMALL = ['model.n_layers=2', 'data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=1',
         'train.eval_batches=1', 'train.log_every=1', 'train.split_every=0']


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = [line for line in err.strip().splitlines() if not line.startswith('prepare:')]
  assert len(lines) == 1, err
  assert lines[0].startswith('dos-jax: error: ')
  assert 'Traceback' not in err
  return lines[0]


def _small_folder(tmp_path, num_bytes):
  """A folder with one text file of `num_bytes` bytes of real source text."""
  folder = tmp_path / 'notes'
  folder.mkdir()
  with open(os.path.join(os.path.dirname(os.__file__), 'argparse.py'), 'rb') as f:
    (folder / 'a.txt').write_bytes(f.read(num_bytes))
  return folder


def test_prepare_a_small_folder_then_train_it(tmp_path, capsys):
  """12.6 kB of text at 1% validation was a 126-token split that crashed training after
  5 steps; prepare now raises the split to its minimum and says so, and training runs,
  printing where its outputs go."""
  folder = _small_folder(tmp_path, 12_600)
  out = tmp_path / 'tokens'
  assert cli.main(['prepare', str(folder), '--out', str(out)]) == 0
  err = capsys.readouterr().err
  assert 'prepare: warning: validation split raised from 126 to' in err
  meta = data.load_meta(out)
  assert meta.val_tokens == data.MIN_VAL_TOKENS
  assert meta.train_tokens + meta.val_tokens == 12_600
  run = tmp_path / 'run'
  assert cli.main(['train', *_sets(f'data.path={out}', *SMALL, 'train.steps=2',
                                   f'train.out_dir={run}')]) == 0
  err = capsys.readouterr().err
  assert f'run directory: {run}' in err and 'finished step 2' in err


def test_a_corpus_too_small_for_seq_len_is_refused_before_training(tmp_path, capsys):
  folder = _small_folder(tmp_path, 200)
  out = tmp_path / 'tokens'
  assert cli.main(['prepare', str(folder), '--out', str(out)]) == 0
  assert 'too small' in capsys.readouterr().err
  run = tmp_path / 'run'
  code = cli.main(['train', *_sets(f'data.path={out}', 'train.steps=2', f'train.out_dir={run}')])
  assert code == 2
  line = _one_error_line(capsys)
  assert f'--set data.path={out}: data.path: {out}' in line
  assert 'fewer than data.seq_len + 1 = 129' in line
  assert not run.exists()


def test_prepared_files_follow_the_umask(tmp_path):
  out = tmp_path / 'tokens'
  data.prepare([_small_folder(tmp_path, 5000)], out, progress=False)
  expected = cache.umask_mode(0o666)
  for name in ('train.bin', 'val.bin', 'meta.json'):
    assert stat.S_IMODE(os.stat(out / name).st_mode) == expected, name


def test_prepare_of_an_empty_folder_is_one_line_and_leaves_nothing(tmp_path, capsys):
  (tmp_path / 'empty').mkdir()
  out = tmp_path / 'tokens'
  assert cli.main(['prepare', str(tmp_path / 'empty'), '--out', str(out)]) == 2
  assert 'no text found' in _one_error_line(capsys)
  assert not out.exists()
  code = cli.main(['train', *_sets(f'data.path={tmp_path / "empty"}', 'train.steps=1',
                                   f'train.out_dir={tmp_path / "run"}')])
  assert code == 2
  assert 'is not a prepared dataset' in _one_error_line(capsys)
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('args, expected', [
    (['--set', 'offload.policy=gpu'],
     "--set offload.policy=gpu: offload.policy: expected one of 'all_host'"),
    (['--set', 'optim.lr=abc'], "--set optim.lr=abc: optim.lr: expected a positive float"),
    (['--set', 'mesh.data=2'], '--set mesh.data=2: mesh: '),
    (['--set', 'mesh.data=3'], '--set mesh.data=3: data.batch_size: 32 is not divisible'),
    (['--set', 'train.steps', '10'],
     '--set train.steps 10: expected KEY=VALUE with no spaces, e.g. --set train.steps=10'),
    (['--set', 'train.out_dir='], '--set train.out_dir=: train.out_dir: expected a non-empty'),
    (['--set', 'train.metrics_file=../x.jsonl'],
     'train.metrics_file: must be a file name inside train.out_dir'),
    (['--set', 'train.metrics_file=/tmp/x.jsonl'],
     'train.metrics_file: must be a file name inside train.out_dir'),
])
def test_set_errors_blame_the_set_argument(tmp_path, capsys, monkeypatch, args, expected):
  monkeypatch.chdir(tmp_path)
  assert cli.main(['train', *args]) == 2
  line = _one_error_line(capsys)
  assert expected in line
  assert '<packaged' not in line
  assert os.listdir(tmp_path) == []


def test_file_errors_still_blame_the_file(tmp_path, capsys):
  path = tmp_path / 'run.yaml'
  path.write_text('optim:\n  lr: -1\n')
  assert cli.main(['train', str(path), '--set', 'train.steps=3']) == 2
  assert f'{path}: optim.lr: expected a positive float' in _one_error_line(capsys)


def test_duplicate_yaml_keys_are_refused(tmp_path, capsys):
  path = tmp_path / 'run.yaml'
  path.write_text('train:\n  steps: 5\noptim:\n  lr: 1.0e-3\ntrain:\n  out_dir: x\n')
  assert cli.main(['train', str(path)]) == 2
  assert (f"{path}: duplicate key 'train' (line 5; first given on line 1)"
          in _one_error_line(capsys))
  path.write_text('optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n')
  with pytest.raises(config.ConfigError, match="duplicate key 'lr'"):
    config.load(str(path))


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path, capsys, monkeypatch):
  afile = tmp_path / 'afile'
  afile.write_text('x')
  base = ['train', '--set', 'train.steps=1']
  cases = [
      ([f'train.out_dir={afile}'], f'train.out_dir: {afile} exists and is not a directory'),
      ([f'train.out_dir={afile}/run'], 'train.out_dir: '),
      ([f'train.out_dir={tmp_path / "run"}', f'checkpoint.dir={afile}'],
       f'checkpoint.dir: {afile} exists and is not a directory'),
  ]
  for sets, expected in cases:
    assert cli.main([*base, *_sets(*sets)]) == 2
    assert expected in _one_error_line(capsys)
  # A read-only folder (simulated: the tests may run as root, whom permissions do not stop).
  real_access = os.access
  readonly = tmp_path / 'readonly'
  readonly.mkdir()
  monkeypatch.setattr(os, 'access', lambda p, m: False if str(p) == str(readonly)
                      else real_access(p, m))
  assert cli.main([*base, *_sets(f'train.out_dir={readonly / "run"}')]) == 2
  assert f'cannot be written (no write permission on {readonly})' in _one_error_line(capsys)
  assert sorted(os.listdir(tmp_path)) == ['afile', 'readonly']
  assert not os.listdir(readonly)


def test_train_help_lists_the_allowed_values(capsys):
  with pytest.raises(SystemExit):
    cli.main(['train', '--help'])
  out = capsys.readouterr().out
  policy = next(line for line in out.splitlines() if line.strip().startswith('offload.policy'))
  for value in ('all_host', 'all_device', 'stride', 'device_fraction', 'auto'):
    assert f"'{value}'" in policy


def test_one_cache_dir_for_data_and_calibration(tmp_path, monkeypatch):
  from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel

  monkeypatch.delenv('DOS_JAX_CACHE_DIR', raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert data.default_cache_dir() == tmp_path / 'xdg' / 'dos_jax' / 'data' / 'stdlib-bytes'
  assert os.path.dirname(calibrate.profile_path('cpu')) == str(tmp_path / 'xdg' / 'dos_jax')
  monkeypatch.setenv('DOS_JAX_CACHE_DIR', str(tmp_path / 'mine'))
  assert data.default_cache_dir() == tmp_path / 'mine' / 'data' / 'stdlib-bytes'
  assert os.path.dirname(calibrate.profile_path('cpu')) == str(tmp_path / 'mine')


def test_eta_leaves_out_the_steps_that_compiled():
  """Step 1 compiles for 100 s, then steps take 0.5 s: 98 steps left read 49 s, not
  ~50 min as the wall-clock average says."""
  stream = io.StringIO()
  progress = Progress(100, every=1, stream=stream)
  progress.update(1, loss=5.0, tokens_per_s=1.0, step_s=100.0, update_s=0.1, compiled=True)
  assert stream.getvalue().rstrip().endswith('eta ?')
  progress.update(2, loss=5.0, tokens_per_s=1.0, step_s=0.5, update_s=0.1)
  assert stream.getvalue().rstrip().endswith('eta 49s')


@pytest.mark.parametrize('tokens_per_s,shown', [
    (0.41, '0.41 tok/s'), (5.0, '5 tok/s'), (812.4, '812 tok/s'), (4512.0, '4.5k tok/s'),
    (2.5e6, '2.50M tok/s')])
def test_a_slow_steps_rate_is_not_rounded_to_zero(tokens_per_s, shown):
  """A 2B model's step on a CPU is over a minute: 32 tokens read 0.41 tok/s, not 0."""
  stream = io.StringIO()
  Progress(4, every=1, stream=stream).update(
      1, loss=5.0, tokens_per_s=tokens_per_s, step_s=78.0, update_s=60.0)
  assert f'| {shown} |' in stream.getvalue()


@pytest.mark.slow
def test_the_gpu_checks_step_part_runs_on_this_machines_backend(tmp_path):
  """`experiments/gpu_check.sh` parts 4 and 11 run `compile_gpu.py --run`, which must also
  run on a CPU (`gpu_check.sh --small`, the smoke test): the step's attention is resolved
  for this backend, not for a GPU (cuDNN is not on a CPU). Two steps of the packaged
  tiny config (the two-memory program's one construction), timed and written as JSON."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  script = pathlib.Path(__file__).parents[1] / 'experiments' / 'compile_gpu.py'
  out = tmp_path / 'step.json'
  done = subprocess.run(
      [sys.executable, str(script), '--run', '2', '--policy', 'stride', '--json', str(out)],
      capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  report = json.loads(out.read_text())
  report = report[0] if isinstance(report, list) else report
  assert report['steps'] == 2 and report['median_step_s'] > 0, report
  assert report['backend'] == 'cpu', report  # resolved for this machine, not a GPU
  # Uniformly random tokens: nothing to learn in three steps, so the loss of the fresh
  # model is the uniform code length ln(vocab) (within 0.5 nats; an update that blew
  # up, or a step that never ran the model, would be far from it).
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  vocab = config_lib.load(None, []).model.shape().vocab_size
  assert abs(report['loss'] - np.log(vocab)) < 0.5, (report['loss'], np.log(vocab))
  cfg = config_lib.load(None, [])
  tokens = cfg.data.batch_size * cfg.data.seq_len
  np.testing.assert_allclose(report['tokens_per_s'], tokens / report['median_step_s'],
                             rtol=1e-3)
