"""experiments/plot.py: reads runs and benchmark JSON, writes PNGs, or says in one line
that matplotlib (an optional extra) is missing."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT = os.path.join(REPO, 'experiments', 'plot.py')


def _module():
  spec = importlib.util.spec_from_file_location('plot', PLOT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write_run(root, name, rng):
  run = root / name
  run.mkdir(parents=True)
  losses = {step: float(rng.uniform(1, 6)) for step in range(1, 11)}
  lines = [json.dumps({'step': s, 'loss': v, 'tokens_per_s': 100.0 * s}) for s, v in
           losses.items()]
  lines.insert(5, json.dumps({'resumed_from': 5, 'time': 0.0}))
  lines.append(json.dumps({'step': 10, 'eval_loss': 2.5, 'time': 0.0}))
  lines.append(json.dumps({'summary': True, 'final_step': 10, 'final_loss': None}))
  lines.append('{"step": 11, "loss": 1.')  # Cut short by a kill.
  (run / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
  return losses


def test_series_and_bars_are_read_from_the_files(tmp_path, seed):
  plot = _module()
  rng = np.random.default_rng(seed)
  losses = _write_run(tmp_path / 'runs', 'a', rng)
  runs = plot.load_runs(str(tmp_path / 'runs' / '*'))
  assert list(runs) == ['a']
  assert runs['a']['loss'] == sorted(losses.items())
  assert runs['a']['eval_loss'] == [(10, 2.5)]
  assert [s for s, _ in runs['a']['tokens_per_s']] == list(range(2, 11))  # Step 1 compiled.
  update = {'rows': [{'name': 'AllHost', 'median_s': 0.004},
                     {'name': 'Stride(2)', 'status': 'does not fit'}]}
  train = {'results': {'dos_jax': {'update_ms': 3.0}, 'optax': {'update_ms': 2.0}}}
  (tmp_path / 'u.json').write_text(json.dumps(update))
  (tmp_path / 't.json').write_text(json.dumps(train))
  bars = plot.load_update_times([str(tmp_path / 'u.json'), str(tmp_path / 't.json')])
  assert bars == [('u: AllHost', 4.0), ('t: dos_jax', 3.0), ('t: optax', 2.0)]
  (tmp_path / 'x.json').write_text('{}')
  with pytest.raises(ValueError, match='x.json: not a bench_update.py'):
    plot.load_update_times([str(tmp_path / 'x.json')])


def test_two_runs_named_apart_are_overlaid_in_the_order_given(tmp_path, seed):
  plot = _module()
  rng = np.random.default_rng(seed)
  b = _write_run(tmp_path / 'x', 'tiny-none', rng)
  a = _write_run(tmp_path / 'y', 'tiny-all_device', rng)
  runs = plot.load_runs([str(tmp_path / 'x' / 'tiny-none'), str(tmp_path / 'y' / 'tiny-*'),
                         str(tmp_path / 'x' / '*')])
  assert list(runs) == ['tiny-none', 'tiny-all_device']
  assert runs['tiny-none']['loss'] == sorted(b.items())
  assert runs['tiny-all_device']['loss'] == sorted(a.items())


def test_pngs_are_written(tmp_path, seed):
  pytest.importorskip('matplotlib')
  rng = np.random.default_rng(seed)
  _write_run(tmp_path / 'runs', 'a', rng)
  _write_run(tmp_path / 'runs', 'b', rng)
  (tmp_path / 'u.json').write_text(json.dumps({'rows': [{'name': 'AllHost', 'median_s': 0.004}]}))
  done = subprocess.run(
      [sys.executable, PLOT, '--runs', str(tmp_path / 'runs' / '*'), '--bench',
       str(tmp_path / 'u.json'), '--out', str(tmp_path / 'png')],
      capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr
  for name in ('loss.png', 'tokens_per_s.png', 'update_time.png'):
    assert (tmp_path / 'png' / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_missing_matplotlib_is_one_line(tmp_path):
  code = (f'import sys; sys.modules["matplotlib"] = None; sys.argv = ["plot.py"];'
          f' exec(open({PLOT!r}).read())')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=60, check=False, cwd=tmp_path)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
      "plot.py: error: matplotlib is not installed; pip install 'dos_jax[plot]'"
      ' (or pip install matplotlib)'
  ]
