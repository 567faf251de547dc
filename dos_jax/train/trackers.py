"""Where a run's metrics go: `metrics.jsonl`, TensorBoard event files, a W&B run.

The loop hands every metrics record (a step's, an evaluation's, the resume marker, the
summary) to one `Trackers`, which cleans it once (floats rounded as `metrics.jsonl`
keeps them, NaN as null) and gives the same record to each tracker of
`track.trackers`. A tracker is anything with `write(record)` and `close()`:

- `jsonl`: `progress.MetricsLog` (the file, cut back to the resumed step).
- `tensorboard`: tensorboardX's `SummaryWriter` in `<out_dir>/tensorboard`; a resumed
  run purges the events past its checkpoint (TensorBoard's own purge marker).
- `wandb`: `wandb.init` in `<out_dir>/wandb`; the run id is kept in
  `<out_dir>/wandb/run_id`, so a resumed run continues the same W&B run.

Each scalar (a number or a bool, never null) of a record with a `step` goes to each
tracker at that step; `time` is the record's wall time, not a scalar. The summary
record goes to W&B's run summary and to TensorBoard as `summary/<key>` at its
`final_step`. The resolved config goes as hyperparameters. Only process 0 tracks.

Example:
  >>> import os, tempfile
  >>> from dos_jax.train import config
  >>> folder = tempfile.mkdtemp()
  >>> cfg = config.load(None, [f'train.out_dir={folder}'])
  >>> tracks = open_trackers(cfg, resume_step=0)
  >>> tracks.write({'step': 1, 'loss': 5.5, 'time': 0.0})
  >>> tracks.close()
  >>> open(os.path.join(folder, 'metrics.jsonl')).read()
  '{"step": 1, "loss": 5.5, "time": 0.0}\\n'
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

from dos_jax.train.configlib import ConfigError, to_dict
from dos_jax.train.progress import MetricsLog, clean

TENSORBOARD_DIR = 'tensorboard'
WANDB_DIR = 'wandb'
WANDB_RUN_ID = 'run_id'  # in WANDB_DIR: the W&B run a resumed run continues

# The package each tracker imports, and the extra that installs it.
_NEEDS = {'tensorboard': ('tensorboardX', 'tensorboard'), 'wandb': ('wandb', 'wandb')}


class Tracker(Protocol):
  def write(self, record: dict[str, Any]) -> None:
    """Takes one cleaned metrics record."""

  def close(self) -> None:
    """Flushes and closes (idempotent)."""


def check_installed(cfg) -> None:
  """Raises ConfigError naming the extra of the first tracker whose package is missing."""
  for name in cfg.track.trackers:
    if name not in _NEEDS:
      continue
    module, extra = _NEEDS[name]
    try:
      importlib.import_module(module)
    except ImportError:
      raise ConfigError(f'track.trackers: {name!r} needs the {module} package, which is not'
                        f' installed: pip install "dos_jax[{extra}]"') from None


def scalars(record: dict[str, Any]) -> dict[str, float | int | bool]:
  """The scalars of a cleaned record: its numbers and bools, less `step`, `time` and
  the summary record's mark."""
  return {k: v for k, v in record.items()
          if k not in ('step', 'time', 'summary') and isinstance(v, (int, float, bool))}


def hyperparameters(cfg) -> dict[str, Any]:
  """The resolved config flattened to dotted keys (`optim.lr`), lists as their YAML-ish
  text and null as 'null': what TensorBoard's hparams accept."""
  flat: dict[str, Any] = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f'{prefix}{key}.')
      elif value is None:
        flat[prefix + key] = 'null'
      elif isinstance(value, list):
        flat[prefix + key] = str(value)
      else:
        flat[prefix + key] = value

  walk(to_dict(cfg), '')
  return flat


class Trackers:
  """The run's trackers behind one `write`: each record cleaned once, given to all."""

  def __init__(self, trackers: list[Tracker]):
    self._trackers = trackers

  def write(self, record: dict[str, Any]) -> None:
    cleaned = clean(record)
    for tracker in self._trackers:
      tracker.write(cleaned)

  def close(self) -> None:
    errors = []
    for tracker in self._trackers:
      try:
        tracker.close()
      except Exception as err:  # pylint: disable=broad-exception-caught
        errors.append(err)
    if errors:
      raise errors[0]


def open_trackers(cfg, *, resume_step: int, process_index: int = 0) -> Trackers:
  """Opens `cfg.track.trackers` for a run resumed at `resume_step` (0: a fresh run);
  none on a process other than 0."""
  if process_index != 0:
    return Trackers([])
  opened: list[Tracker] = []
  try:
    for name in cfg.track.trackers:
      if name == 'jsonl':
        opened.append(MetricsLog(cfg.metrics_path, resume_step=resume_step))
      elif name == 'tensorboard':
        opened.append(TensorBoard(cfg, resume_step=resume_step))
      else:
        opened.append(Wandb(cfg))
  except BaseException:
    Trackers(opened).close()
    raise
  return Trackers(opened)


class TensorBoard:
  """Scalars as TensorBoard events (tensorboardX; no TensorFlow), the config as hparams."""

  def __init__(self, cfg, *, resume_step: int):
    import tensorboardX  # pylint: disable=import-outside-toplevel
    from tensorboardX import summary  # pylint: disable=import-outside-toplevel

    # Events of steps past the checkpoint belong to lost work: a purge marker at the
    # first step this run writes hides them from TensorBoard's readers.
    self._writer = tensorboardX.SummaryWriter(
        os.path.join(cfg.train.out_dir, TENSORBOARD_DIR),
        purge_step=resume_step + 1 if resume_step else None, flush_secs=10)
    if not resume_step:
      for event in summary.hparams(hyperparameters(cfg), {}):
        self._writer.file_writer.add_summary(event)

  def write(self, record: dict[str, Any]) -> None:
    if record.get('summary'):
      step, prefix = record.get('final_step'), 'summary/'
    else:
      step, prefix = record.get('step'), ''
    if not isinstance(step, int):
      return
    for key, value in scalars(record).items():
      self._writer.add_scalar(prefix + key, float(value), global_step=step,
                              walltime=record.get('time'))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class Wandb:
  """A Weights & Biases run: the scalars at each step, the summary, the config."""

  def __init__(self, cfg):
    import wandb  # pylint: disable=import-outside-toplevel

    folder = os.path.join(cfg.train.out_dir, WANDB_DIR)
    os.makedirs(folder, exist_ok=True)
    id_path = os.path.join(folder, WANDB_RUN_ID)
    run_id = None
    if os.path.isfile(id_path):
      with open(id_path, encoding='utf-8') as f:
        run_id = f.read().strip() or None
    name = cfg.track.wandb.name or os.path.basename(os.path.abspath(cfg.train.out_dir))
    try:
      self._run = wandb.init(
          project=cfg.track.wandb.project, name=name, tags=list(cfg.track.wandb.tags),
          config=to_dict(cfg), dir=cfg.train.out_dir, id=run_id, resume='allow')
    except wandb.Error as err:
      raise ConfigError(f'track.trackers: wandb could not start its run ({err}); set'
                        ' WANDB_MODE=offline to log without a W&B server') from None
    if run_id is None:  # A fresh run: W&B's id, kept for the resumes.
      with open(id_path, 'w', encoding='utf-8') as f:
        f.write(self._run.id + '\n')

  def write(self, record: dict[str, Any]) -> None:
    if self._run is None:
      return
    if record.get('summary'):
      self._run.summary.update(scalars(record))
    elif isinstance(record.get('step'), int):
      values = scalars(record)
      if values:
        self._run.log(values, step=record['step'])

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None
