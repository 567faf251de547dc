"""`dos-jax train` / `dos-jax prepare`: user errors are one line and exit 2; runs report."""

import os
import subprocess
import sys

import pytest

from dos_jax import cli
from dos_jax.train import config, data, trainer
from dos_jax.train.progress import read_metrics

# Two layers instead of four: the same code, compiled in half the time.
SMALL = ['data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=1', 'train.steps=3',
         'train.eval_batches=1', 'train.log_every=1', 'model.n_layers=2']


def _sets(*items):
  args = []
  for item in items:
    args += ['--set', item]
  return args


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith('dos-jax: error: ')
  assert 'Traceback' not in err
  return lines[0]


@pytest.mark.parametrize(
    'yaml_text, overrides, culprit',
    [
        ('optim:\n  lr: abc\n', [], "optim.lr: expected a positive float, got 'abc'"),
        ('train:\n  stepz: 3\n', [], 'train.stepz: unknown key'),
        ('', ['offload.policy=gpu'], 'offload.policy: expected one of'),
        ('', ['mesh.data=4'], 'mesh: data*tensor*pipeline = 4*1*1 = 4 but 8 device(s)'),
        ('', ['mesh.tensor=3'], 'mesh: tensor*pipeline = 3 does not divide the 8'),
        ('', ['data.path=/nonexistent/tokens'], 'data.path: dataset directory /nonexistent'),
        ('model:\n  preset: 3b\n', [], "model.preset: unknown preset '3b'"),
    ],
)
def test_bad_config_is_one_line_exit_2_and_writes_nothing(
    tmp_path, capsys, yaml_text, overrides, culprit
):
  path = tmp_path / 'run.yaml'
  path.write_text(yaml_text)
  out_dir = tmp_path / 'out'
  code = cli.main(['train', str(path), *_sets(f'train.out_dir={out_dir}', *overrides)])
  assert code == 2
  line = _one_error_line(capsys)
  assert culprit in line
  # The culprit's source: the `--set` argument that set the key, else the file.
  assert (f'--set {overrides[0]}: ' in line) if overrides else (f'{path}: ' in line)
  assert not out_dir.exists()


def test_bad_config_in_a_real_process(tmp_path):
  """The console entry point itself: exit status 2, one stderr line, no traceback."""
  path = tmp_path / 'bad.yaml'
  path.write_text('optim:\n  lr: -1\n')
  done = subprocess.run(
      [sys.executable, '-m', 'dos_jax.cli', 'train', str(path),
       '--set', f'train.out_dir={tmp_path / "out"}'],
      capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
  )
  assert done.returncode == 2
  assert done.stderr.strip() == (
      f'dos-jax: error: {path}: optim.lr: expected a positive float, got -1'
  )
  assert sorted(os.listdir(tmp_path)) == ['bad.yaml']


def test_train_help_lists_the_config_keys(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(['train', '--help'])
  assert info.value.code == 0
  out = capsys.readouterr().out
  for key in ('--set KEY=VALUE', 'optim.lr', 'offload.policy', 'mesh.tensor', "'tiny'"):
    assert key in out


def test_prepare_rejects_missing_inputs_and_writes_nothing(tmp_path, capsys):
  out = tmp_path / 'tokens'
  assert cli.main(['prepare', str(tmp_path / 'missing.txt'), '--out', str(out)]) == 2
  assert 'missing.txt: no such file or directory' in _one_error_line(capsys)
  assert cli.main(['prepare', __file__, '--out', str(out), '--val-fraction', '1.5']) == 2
  assert 'val_fraction' in _one_error_line(capsys)
  assert not out.exists()


def test_prepare_writes_a_dataset_the_runner_accepts(tmp_path, capsys):
  sources = [os.path.join(os.path.dirname(os.__file__), name)
             for name in ('argparse.py', 'dataclasses.py')]
  out = str(tmp_path / 'tokens')
  assert cli.main(['prepare', *sources, '--out', out, '--val-fraction', '0.1']) == 0
  assert 'wrote ' in capsys.readouterr().err
  assert sorted(os.listdir(out)) == ['meta.json', 'train.bin', 'val.bin']
  meta = data.load_meta(out)
  total = sum(os.path.getsize(p) for p in sources)  # Byte tokenizer: a token per byte.
  assert meta.train_tokens + meta.val_tokens == total
  assert abs(meta.val_tokens - 0.1 * total) <= 1
  cfg = config.load(None, [f'data.path={out}'])
  assert trainer.dataset_dir_for(cfg.data) == out


@pytest.mark.slow
def test_default_run_from_any_directory_writes_its_outputs(tmp_path, monkeypatch, capsys):
  """`dos-jax train` with no CONFIG runs the packaged tiny config from any directory: the
  default corpus is prepared into the cache on first use (here a temporary XDG cache);
  the run writes its config, metrics and checkpoints; run again it has nothing to do."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  assert cli.main(['train', *_sets(*SMALL)]) == 0
  err = capsys.readouterr().err
  assert 'finished step 3' in err and 'tok/s' in err and 'update' in err
  assert os.path.isfile(tmp_path / 'cache' / 'dos_jax' / 'data' / 'stdlib-bytes' / 'meta.json')
  out_dir = tmp_path / 'runs' / 'tiny'
  assert sorted(os.listdir(out_dir)) == ['checkpoints', 'config.yaml', 'metrics.jsonl']
  assert os.listdir(out_dir / 'checkpoints') == ['3']
  records = read_metrics(str(out_dir / 'metrics.jsonl'))
  steps = [r for r in records if 'loss' in r and 'summary' not in r]
  assert [r['step'] for r in steps] == [1, 2, 3]
  for key in ('loss', 'grad_norm', 'lr', 'tokens_per_s', 'step_s', 'update_s'):
    assert all(isinstance(r[key], float) for r in steps), key
  assert any('eval_loss' in r for r in records)
  assert records[-1]['summary'] and records[-1]['final_step'] == 3
  # The resolved config is itself a valid config, for the same run: nothing left to do.
  assert cli.main(['train', str(out_dir / 'config.yaml')]) == 0
  assert 'nothing to do: the run is already at step 3' in capsys.readouterr().err


@pytest.mark.parametrize('status', [0, 1, 2])
def test_the_command_exits_with_its_status_even_with_a_thread_left_blocked(status):
  """`dos-jax` (`cli.run`) leaves with `main()`'s status. A failed run (1) leaves at once
  even when a library's thread is still blocked (as orbax's can be on a failed write):
  Python would otherwise wait for that thread at exit. The other statuses exit as usual,
  with the interpreter's clean-up, so the blocked thread here is a daemon for them."""
  code = ('import threading, dos_jax.cli as c\n'
          f'threading.Thread(target=threading.Event().wait, daemon={status != 1}).start()\n'
          f'c.main = lambda: {status}\n'
          'c.run()\n')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=60, check=False)
  assert done.returncode == status, done.stderr
