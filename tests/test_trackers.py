"""`track.trackers` and `track.profile_steps`, read back with each tool's own reader.

A run writes metrics.jsonl, TensorBoard event files and an offline W&B run, is cut back
to a checkpoint (its last checkpoint removed: the work after the previous one is lost,
as when a run is killed) and resumed. TensorBoard's `EventAccumulator` (which applies
the purge marker the resumed run writes), and wandb's own `Record` protobuf over the
run files, must hold what metrics.jsonl holds, step for step; the W&B run id stays.
The profiler trace of the chosen steps opens with `jax.profiler.ProfileData` (the
profiler's own reader of `.xplane.pb`) and holds each traced step with the step's
native host call inside it; the traced steps are left out of the run's step time.
"""

import glob
import gzip
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
import yaml

from dos_jax import cli
from dos_jax.train import configlib, config, trackers
from dos_jax.train.progress import read_metrics
from tests.test_runner_reliability import SMALL
from tests.test_runner_reliability import dataset  # pylint: disable=unused-import  (the fixture)

pytest.importorskip('tensorboardX')
pytest.importorskip('wandb')
event_accumulator = pytest.importorskip(
    'tensorboard.backend.event_processing.event_accumulator')
from tensorboard.plugins.hparams import plugin_data_pb2  # pylint: disable=wrong-import-position
from tests import wandb_records  # pylint: disable=wrong-import-position

ALL = 'track.trackers=[jsonl,tensorboard,wandb]'


@pytest.fixture
def offline(monkeypatch):
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  monkeypatch.setenv('WANDB_CONSOLE', 'off')


def _train(dataset, out, capsys, *extra) -> tuple[int, str]:
  args = ['train']
  for item in [f'data.path={dataset}', *SMALL, f'train.out_dir={out}', *extra]:
    args += ['--set', item]
  capsys.readouterr()
  code = cli.main(args)
  return code, capsys.readouterr().err


def _by_step(records) -> dict[int, dict]:
  """metrics.jsonl's scalars per step, the records of one step merged (a step's record
  and the evaluation at it)."""
  rows: dict[int, dict] = {}
  for record in records:
    if isinstance(record.get('step'), int):
      rows.setdefault(record['step'], {}).update(trackers.scalars(record))
  return rows


def _tensorboard(out):
  acc = event_accumulator.EventAccumulator(
      os.path.join(out, trackers.TENSORBOARD_DIR), size_guidance={event_accumulator.SCALARS: 0,
                                                                  event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _trace_steps(xplane: str) -> list[tuple[int, list[str]]]:
  """(step number, names of the XLA ops run inside it) for each step mark of a trace."""
  data = jax.profiler.ProfileData.from_file(xplane)
  marks, ops = [], []
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if event.name == 'train' and 'step_num' in stats:
          marks.append((int(stats['step_num']), event.start_ns, event.start_ns + event.duration_ns))
        elif line.name.startswith('tf_XLA'):  # XLA:CPU's threads: the program's ops
          ops.append((event.name, event.start_ns))
  return [(step, sorted({n for n, t in ops if start <= t <= end})) for step, start, end in
          sorted(marks)]


def test_each_tracker_holds_the_metrics_step_for_step_across_a_resume(
    dataset, offline, tmp_path, capsys):
  out = str(tmp_path / 'run')
  first = [ALL, 'train.steps=3', 'checkpoint.every=2', 'track.profile_steps=[2, 2]',
           'track.wandb.tags=[dos, test]']
  code, err = _train(dataset, out, capsys, *first)
  assert code == 0, err[-3000:]
  assert f'step 2: profiler trace in {os.path.join(out, "profile")}' in err, err[-3000:]
  records = read_metrics(os.path.join(out, 'metrics.jsonl'))
  steps = {r['step']: r for r in records if 'loss' in r}
  assert steps[2]['profiled'] is True and 'profiled' not in steps[3]
  summary = [r for r in records if r.get('summary')][-1]
  # Step 1 compiled, step 2 was traced: only step 3 is timed.
  assert summary['step_s'] == steps[3]['step_s'], (summary, steps)
  with open(os.path.join(out, 'config.yaml'), encoding='utf-8') as f:
    resolved = configlib.from_dict(config.RunConfig, yaml.safe_load(f))

  # The last checkpoint lost: the resumed run continues from step 2.
  shutil.rmtree(os.path.join(out, 'checkpoints', '3'))
  code, err = _train(dataset, out, capsys, ALL, 'train.steps=4', 'checkpoint.every=2')
  assert code == 0, err[-3000:]
  records = read_metrics(os.path.join(out, 'metrics.jsonl'))
  assert {'resumed_from': 2} in [{k: v for k, v in r.items() if k != 'time'} for r in records]
  expected = _by_step(records)
  assert sorted(expected) == [1, 2, 3, 4]
  final = [r for r in records if r.get('summary')][-1]

  # TensorBoard: every tag, step for step (TensorBoard keeps scalars as float32).
  acc = _tensorboard(out)
  tags = {k for row in expected.values() for k in row}
  assert set(acc.Tags()['scalars']) == tags | {f'summary/{k}' for k in trackers.scalars(final)}
  times = {r['step']: r['time'] for r in records if 'loss' in r}
  for tag in tags:
    got = [(e.step, e.value) for e in acc.Scalars(tag)]
    want = [(s, float(np.float32(row[tag]))) for s, row in sorted(expected.items()) if tag in row]
    assert got == want, tag
  assert [(e.step, e.wall_time) for e in acc.Scalars('loss')] == sorted(times.items())
  for key, value in trackers.scalars(final).items():
    assert [(e.step, e.value) for e in acc.Scalars(f'summary/{key}')] == [
        (4, float(np.float32(value)))], key
  start = plugin_data_pb2.HParamsPluginData.FromString(
      acc.PluginTagToContent('hparams')['_hparams_/session_start_info']).session_start_info
  hparams = {k: getattr(v, v.WhichOneof('kind')) for k, v in start.hparams.items()}
  assert hparams == pytest.approx(trackers.hyperparameters(resolved))

  # W&B: one run id in both run files; each file's history is the metrics of its steps.
  files = wandb_records.run_files(os.path.join(out, trackers.WANDB_DIR))
  assert len(files) == 2, files
  with open(os.path.join(out, trackers.WANDB_DIR, trackers.WANDB_RUN_ID), encoding='utf-8') as f:
    run_id = f.read().strip()
  runs = [wandb_records.first(path, 'run') for path in files]
  assert [r.run_id for r in runs] == [run_id, run_id]
  assert (runs[0].project, runs[0].display_name, list(runs[0].tags)) == ('dos_jax', 'run',
                                                                       ['dos', 'test'])
  config_update = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
  assert config_update['optim'] == configlib.to_dict(resolved)['optim']
  histories = [wandb_records.history(path) for path in files]
  assert sorted(histories[0]) == [1, 2, 3] and sorted(histories[1]) == [3, 4]
  for step, row in expected.items():
    logged = histories[0 if step <= 2 else 1][step]
    assert {k: v for k, v in logged.items() if not k.startswith('_')} == row, step
  summary_items = {}
  for record in wandb_records.records(files[1]):
    if record.WhichOneof('record_type') == 'summary':
      summary_items.update({i.key: json.loads(i.value_json) for i in record.summary.update})
  for key, value in trackers.scalars(final).items():
    assert summary_items[key] == value, key

  # The traces: the first run's of step 2, the resumed run's none (its steps are 3, 4).
  xplanes = glob.glob(os.path.join(out, 'profile', 'plugins', 'profile', '*', '*.xplane.pb'))
  assert len(xplanes) == 1, xplanes
  traced = _trace_steps(xplanes[0])
  assert [step for step, _ in traced] == [2], traced
  assert any(name.startswith('ffi_call') for name in traced[0][1]), traced  # the host call
  perfetto = glob.glob(os.path.join(os.path.dirname(xplanes[0]), '*.trace.json.gz'))
  with gzip.open(perfetto[0]) as f:
    names = {e.get('name') for e in json.load(f)['traceEvents']}
  assert 'train' in names


def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra(
    dataset, tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)  # what Python does for a missing one
  out = tmp_path / 'run'
  code, err = _train(dataset, str(out), capsys, 'track.trackers=[jsonl, tensorboard]')
  assert code == 2
  assert err.strip().splitlines() == [
      'dos-jax: error: --set track.trackers=[jsonl, tensorboard]: track.trackers:'
      " 'tensorboard' needs the tensorboardX package, which is not installed: pip install"
      ' "dos_jax[tensorboard]"'], err
  assert not out.exists()


def test_only_process_0_tracks(tmp_path):
  out = tmp_path / 'run'
  cfg = config.load(None, [f'train.out_dir={out}', 'track.trackers=[jsonl, tensorboard]'])
  tracks = trackers.open_trackers(cfg, resume_step=0, process_index=1)
  tracks.write({'step': 1, 'loss': 1.0, 'time': 0.0})
  tracks.close()
  assert not out.exists()
  tracks = trackers.open_trackers(cfg, resume_step=0, process_index=0)
  tracks.write({'step': 1, 'loss': 1.0, 'time': 0.0})
  tracks.close()
  assert sorted(os.listdir(out)) == ['metrics.jsonl', 'tensorboard']
