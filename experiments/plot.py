"""PNG plots of training runs and benchmark results.

    python experiments/plot.py                       # runs/*/metrics.jsonl -> experiments/plots/
    python experiments/plot.py --runs 'runs/*' --bench update.json train.json --out plots/
    python experiments/plot.py --runs runs/tiny-none runs/tiny-all_device   # overlay two runs

Writes, for what it finds:
  loss.png          training loss (and evaluation loss, dots) against step, one colour per run;
  tokens_per_s.png  training throughput against step (steps that compiled left out);
  update_time.png   optimizer update time per placement policy, from `bench_update.py
                    --json` files (median ms per row) and `bench_train.py --json` files
                    (update ms per run).

Needs matplotlib, an optional extra: `pip install 'dos_jax[plot]'`. Reading the files
needs nothing beyond the standard library, so the loaders are tested without it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The records of a metrics file; a line cut short by a kill is skipped."""
  records = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict):
        records.append(record)
  return records


def run_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
  """(step, value) series of one run: 'loss', 'eval_loss', 'tokens_per_s'.

  A step logged twice (by a run resumed from an older checkpoint, in files written
  before resumes truncated them) keeps its latest value.
  """
  series: dict[str, dict[int, float]] = {'loss': {}, 'eval_loss': {}, 'tokens_per_s': {}}
  for record in records:
    if record.get('summary') or not isinstance(record.get('step'), int):
      continue
    for key, values in series.items():
      if isinstance(record.get(key), (int, float)):
        values[record['step']] = float(record[key])
  first = min(series['tokens_per_s'], default=None)
  if first is not None:
    del series['tokens_per_s'][first]  # A run's first step compiles: not its throughput.
  return {key: sorted(values.items()) for key, values in series.items()}


def load_runs(patterns: str | list[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{run name: series} for every `<run>/metrics.jsonl` the globs `patterns` match, in
  the order given (sorted within one glob); each run once."""
  patterns = [patterns] if isinstance(patterns, str) else patterns
  directories = [d for pattern in patterns for d in sorted(glob.glob(pattern))]
  runs = {}
  for directory in dict.fromkeys(directories):
    path = os.path.join(directory, 'metrics.jsonl')
    if os.path.isfile(path):
      runs[os.path.basename(os.path.normpath(directory))] = run_series(read_jsonl(path))
  return runs


def load_update_times(paths: list[str]) -> list[tuple[str, float]]:
  """(label, update ms) bars from benchmark JSON files; unknown files are refused."""
  bars = []
  for path in paths:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    prefix = f'{os.path.splitext(os.path.basename(path))[0]}: ' if len(paths) > 1 else ''
    if isinstance(record.get('rows'), list):  # bench_update.py
      for row in record['rows']:
        if isinstance(row.get('median_s'), (int, float)):
          bars.append((prefix + row['name'], row['median_s'] * 1e3))
    elif isinstance(record.get('results'), dict):  # bench_train.py
      for name, row in record['results'].items():
        if isinstance(row.get('update_ms'), (int, float)):
          bars.append((prefix + name, float(row['update_ms'])))
    else:
      raise ValueError(f'{path}: not a bench_update.py or bench_train.py --json file')
  return bars


def _pyplot():
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_losses(plt, runs, out: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (name, series) in enumerate(runs.items()):
    color = f'C{i % 10}'
    if series['loss']:
      ax.plot(*zip(*series['loss']), color=color, lw=1.2, label=f'{name} train')
    if series['eval_loss']:
      ax.plot(*zip(*series['eval_loss']), 'o--', color=color, ms=4, label=f'{name} eval')
  ax.set(xlabel='step', ylabel='loss (nats/token)', title='Loss')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, out, 'loss.png')


def plot_throughput(plt, runs, out: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (name, series) in enumerate(runs.items()):
    if series['tokens_per_s']:
      ax.plot(*zip(*series['tokens_per_s']), color=f'C{i % 10}', lw=1, label=name)
  ax.set(xlabel='step', ylabel='tokens / s', title='Training throughput')
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, out, 'tokens_per_s.png')


def plot_update_times(plt, bars, out: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(bars)))
  labels, values = zip(*bars)
  ax.barh(range(len(bars)), values, color='C0')
  ax.set_yticks(range(len(bars)), labels, fontsize=8)
  ax.invert_yaxis()
  for y, value in enumerate(values):
    ax.text(value, y, f' {value:.1f}', va='center', fontsize=8)
  ax.set(xlabel='update time (ms, median)', title='Optimizer update time per policy')
  ax.grid(axis='x', alpha=0.3)
  return _save(fig, out, 'update_time.png')


def _save(fig, out: str, name: str) -> str:
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  fig.clf()
  return path


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--runs', nargs='+', default=['runs/*'], metavar='GLOB',
                      help="run directories or globs of them, overlaid in one plot per"
                           " metric (default 'runs/*')")
  parser.add_argument('--bench', nargs='*', default=[], metavar='JSON',
                      help='bench_update.py / bench_train.py --json outputs')
  parser.add_argument('--out', default=os.path.join('experiments', 'plots'),
                      help='directory for the PNG files (default experiments/plots)')
  args = parser.parse_args(argv)
  plt = _pyplot()
  if plt is None:
    print("plot.py: error: matplotlib is not installed; pip install 'dos_jax[plot]'"
          ' (or pip install matplotlib)', file=sys.stderr)
    return 2
  try:
    runs = load_runs(args.runs)
    bars = load_update_times(args.bench)
  except (OSError, ValueError) as err:
    print(f'plot.py: error: {err}', file=sys.stderr)
    return 2
  if not runs and not bars:
    print(f'plot.py: error: no {" ".join(args.runs)}/metrics.jsonl and no --bench file'
          ' to plot',
          file=sys.stderr)
    return 2
  written = []
  if runs:
    written += [plot_losses(plt, runs, args.out), plot_throughput(plt, runs, args.out)]
  if bars:
    written.append(plot_update_times(plt, bars, args.out))
  for path in written:
    print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
