"""What a new user runs into first, each checked: relative paths, the exported files'
modes, the end-of-run line, the YAML error's line, what `train --help` says each key
accepts, and the suite's own warnings."""

import dataclasses
import io
import math
import os
import shutil
import stat
import types
import typing
import warnings

import optax
import pytest

from dos_jax import cli
from dos_jax.train import checkpoint as ckpt_lib
from dos_jax.train import config, configlib, loop, model, progress


def _tiny_run(root) -> None:
  """RUN/config.yaml (the packaged tiny config) and a checkpoint of step 1 in
  RUN/checkpoints, as `dos-jax train` leaves them, without training."""
  run = root / 'runs' / 'tiny'
  run.mkdir(parents=True)
  shutil.copy(config.__file__.replace('config.py', 'configs/tiny.yaml'), run / 'config.yaml')
  cfg = config.load(str(run / 'config.yaml'))
  params = model.init_params(cfg.model, 0)
  saver = ckpt_lib.Checkpointer(str(run / 'checkpoints'), keep=1, async_save=False)
  saver.save(1, params=params, opt_state=optax.sgd(0.1).init(params), meta={'step': 1})
  saver.close()


def test_export_hf_takes_the_readmes_relative_paths_and_writes_readable_files(
    tmp_path, monkeypatch, capsys):
  """`dos-jax export-hf runs/tiny --out tiny-hf` from the run's parent folder (orbax
  refuses relative checkpoint paths), and every exported file 0666 less the umask."""
  _tiny_run(tmp_path)
  monkeypatch.chdir(tmp_path)
  old = os.umask(0o027)
  try:
    assert cli.main(['export-hf', 'runs/tiny', '--out', 'tiny-hf']) == 0, capsys.readouterr().err
  finally:
    os.umask(old)
  names = sorted(os.listdir(tmp_path / 'tiny-hf'))
  assert 'model.safetensors' in names and 'config.json' in names
  for name in names:
    mode = stat.S_IMODE(os.stat(tmp_path / 'tiny-hf' / name).st_mode)
    assert mode == 0o640, (name, oct(mode))


def _summary(**changes) -> loop.Summary:
  fields = dict(start_step=0, final_step=1, final_loss=5.5, eval_loss=5.4, seconds=9.0,
                tokens_per_s=math.nan, step_s=math.nan, update_s=math.nan, split_steps=0,
                interrupted=False)
  return loop.Summary(**{**fields, **changes})


@pytest.mark.parametrize('changes', [
    {},  # `--set train.steps=1`: the only step compiled
    {'interrupted': True, 'signal': 2},
    {'tokens_per_s': 1234.0, 'step_s': 0.5},  # no split step: the update not measured
])
def test_the_end_of_run_line_has_no_nan(changes):
  line = _summary(**changes).line()
  assert 'nan' not in line.lower(), line
  assert 'loss 5.5000' in line


def test_the_progress_line_has_no_nan():
  out = io.StringIO()
  bar = progress.Progress(1, stream=out, every=1)
  bar.update(1, loss=5.5, tokens_per_s=math.nan, step_s=0.5, update_s=math.nan,
             compiled=True)
  assert out.getvalue() and 'nan' not in out.getvalue().lower(), out.getvalue()


@pytest.mark.parametrize('text, line, what', [
    ('model:\n  preset: tiny\ntrain:\n  steps: [1, 2\n', 4, "'['"),  # 4 lines
    ('train:\n  steps: 3\noptim: {lr: 1e-3\n', 3, "'{'"),
    ("train:\n  out_dir: 'runs/x\n", 2, "\"'\""),
    ('train:\n  steps: 3\n bad: 1\n', 3, ''),  # indentation: PyYAML's own words
])
def test_a_yaml_mistake_is_reported_on_its_line(text, line, what):
  with pytest.raises(configlib.ConfigError) as err:
    configlib.read_yaml(text, 'run.yaml')
  assert f'(line {line}:' in str(err.value) and what in str(err.value), str(err.value)


def _leaf_keys(cls, prefix=''):
  for f in dataclasses.fields(cls):
    if not f.init:
      continue  # derived, not read from the config
    tp = typing.get_type_hints(cls)[f.name]
    if dataclasses.is_dataclass(tp):
      yield from _leaf_keys(tp, f'{prefix}{f.name}.')
    else:
      yield f'{prefix}{f.name}', tp


def test_train_help_says_what_each_key_accepts(capsys):
  with pytest.raises(SystemExit):
    cli.main(['train', '--help'])
  text = capsys.readouterr().out
  rows = {line.split()[0]: line for line in text.splitlines() if '(accepts: ' in line}
  keys = dict(_leaf_keys(config.RunConfig))
  assert set(keys) <= set(rows), set(keys) - set(rows)
  for key, tp in keys.items():
    accepted = rows[key].split('(accepts: ', 1)[1]
    arms = (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType)
            else (tp,))
    for arm in arms:
      if arm is int:
        assert 'integer' in accepted, rows[key]
      if arm is float:
        assert 'float' in accepted, rows[key]
      if arm is bool:
        assert 'true or false' in accepted, rows[key]
      if arm is type(None):
        assert 'null' in accepted, rows[key]
      if typing.get_origin(arm) is typing.Literal:
        for choice in typing.get_args(arm):
          assert repr(choice) in accepted, rows[key]
  # Keys typed as str whose values ModelConfig checks list them too.
  assert "one of 'auto', 'xla', 'cudnn'" in rows['model.attention']
  assert "'bfloat16'" in rows['model.param_dtype'] and "'tiny'" in rows['model.preset']


def test_train_help_says_llama_style(capsys):
  with pytest.raises(SystemExit):
    cli.main(['--help'])
  text = capsys.readouterr().out
  assert 'Llama-style' in text and 'GPT' not in text


def test_a_project_warning_fails_a_test_that_does_not_assert_it():
  """pyproject's `filterwarnings` turns the project's own warnings into errors."""
  with pytest.raises(Warning, match='dos_jax: probe'):
    warnings.warn('dos_jax: probe', UserWarning)
  with pytest.warns(UserWarning, match='dos_jax: asserted'):
    warnings.warn('dos_jax: asserted', UserWarning)
