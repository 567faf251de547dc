"""The training loop: build everything from a `RunConfig`, resume, train, report.

Order matters for the user: everything that can fail because of their input (mesh
sizes, dataset path, batch divisibility) is checked before anything is written, so a
bad run leaves no output directory behind, and a resume that would change the model or
the data stream is refused before anything is written. Ctrl-C or SIGTERM stops at the
next step boundary, saves a checkpoint and returns; a second one aborts at once. A loss,
gradient norm or parameter that is not finite stops the run without saving that step,
so the good checkpoints survive (see `Summary.nonfinite_step`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from typing import Sequence, TextIO

import jax
import yaml

from dos_jax.train import checkpoint as ckpt_lib
from dos_jax.train import data as data_lib
from dos_jax.train import placement as placement_lib
from dos_jax.train import resume as resume_lib
from dos_jax.train import rundir
from dos_jax.train import step_trace
from dos_jax.train import step as step_lib
from dos_jax.train import optimizer as optimizer_lib
from dos_jax.train import trackers as trackers_lib
from dos_jax.train import trainer as trainer_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError, to_dict
from dos_jax.train.progress import Progress, rate


@dataclasses.dataclass(frozen=True)
class Summary:
  """The outcome of `train`.

  Attributes:
    start_step: step the run started from (non-zero after a resume).
    final_step: last step completed.
    final_loss: training loss of the last step (NaN if no step ran).
    eval_loss: validation loss at the end (None if never evaluated).
    seconds: wall time of the loop, compile included.
    tokens_per_s: training throughput, steps that compiled a program excluded.
    step_s: mean step time, steps that compiled excluded (fused and split steps alike:
      the time a step costs in this run).
    update_s: mean update-phase time of the split steps that did not compile (the only
      steps with an update phase of its own; NaN if there were none).
    split_steps: steps run as two programs to time the update (`train.split_every`).
    interrupted: stopped by SIGINT (Ctrl-C) or SIGTERM (a checkpoint of `final_step`
      was saved).
    signal: the number of that signal, else None.
    nonfinite_step: the step whose loss, gradient norm or updated params were not
      finite (the run stopped there and saved nothing from it), else None.
    nonfinite_what: what was not finite at that step.
    last_checkpoint: the newest checkpoint step of the run (None if none).
  """

  start_step: int
  final_step: int
  final_loss: float
  eval_loss: float | None
  seconds: float
  tokens_per_s: float
  step_s: float
  update_s: float
  split_steps: int
  interrupted: bool
  signal: int | None = None
  nonfinite_step: int | None = None
  nonfinite_what: str | None = None
  last_checkpoint: int | None = None

  def line(self) -> str:
    if self.nonfinite_step is not None:
      kept = ('no checkpoint was saved' if self.last_checkpoint is None
              else f'the newest checkpoint is step {self.last_checkpoint}')
      return (f'step {self.nonfinite_step}: not finite ({self.nonfinite_what}); stopped'
              f' without saving it, {kept}')
    if self.final_step == self.start_step and not self.interrupted:
      return f'nothing to do: the run is already at step {self.final_step}'
    eval_part = '' if self.eval_loss is None else f', eval loss {self.eval_loss:.4f}'
    verb = 'interrupted at' if self.interrupted else 'finished'
    if not math.isfinite(self.step_s):
      # Every step this run took compiled a program (e.g. train.steps=1): no step time.
      return (f'{verb} step {self.final_step} in {self.seconds:.1f}s: loss'
              f' {self.final_loss:.4f}{eval_part}; speed not measured (every step'
              ' compiled: time a run of 2 or more steps)')
    update = (f'update {self.update_s * 1e3:.1f} ms' if math.isfinite(self.update_s)
              else 'update not measured')
    return (
        f'{verb} step {self.final_step} in {self.seconds:.1f}s: loss {self.final_loss:.4f}'
        f'{eval_part}, {rate(self.tokens_per_s)} tok/s, step {self.step_s * 1e3:.1f} ms'
        f' ({update})'
    )


class _StopFlag:
  """Turns the first SIGINT or SIGTERM into a request to stop at the next step boundary
  (so that donated buffers are never abandoned mid-update, and the stop saves a
  checkpoint); the second one aborts. Schedulers send SIGTERM before killing a job."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self.signum is not None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.requested:
      raise KeyboardInterrupt
    self.signum = signum

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


def train(
    cfg: RunConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    stream: TextIO | None = None,
) -> Summary:
  """Trains (or resumes) the run `cfg` describes; returns its summary.

  The run holds its folder's lock (`rundir.RunLock`), and its disk tier's state
  folder's (`offload.disk_dir`), from before it builds anything until it returns, so a
  second run on either folder stops at once.

  Raises:
    ConfigError: a mistake in `cfg` found against the machine or the files, or a resume
      that would change the model or the data stream (nothing has been written then).
    RunLocked: another run holds the run folder or the state folder (a ConfigError;
      nothing has been written).
    SaveFailed: a checkpoint could not be written (its temporary files are removed).
  """
  trackers_lib.check_installed(cfg)
  rundir.check(cfg)
  birth = rundir.Birth(cfg)
  try:
    lock = rundir.lock_run(cfg.train.out_dir)
  except OSError as err:
    birth.undo()
    raise rundir.created_error(err, cfg) from None
  # On RunLocked nothing is undone: what looked new may be the other run's by now.
  state_lock = None
  try:
    try:
      state_lock = rundir.lock_state(cfg)
    except OSError as err:
      where = err.filename or cfg.offload.disk_dir
      raise ConfigError(f'offload.disk_dir: cannot write {where}'
                        f' ({err.strerror or type(err).__name__})') from None
    for held in (lock, state_lock):
      line = held.taken_over() if held is not None else None
      if line is not None:
        print(line, file=stream if stream is not None else sys.stderr)
    return _train(cfg, birth, devices=devices, stream=stream)
  except BaseException:
    # A run that ends before any checkpoint exists leaves nothing half-made behind.
    if not ckpt_lib.has_checkpoint(cfg.checkpoint_dir):
      birth.undo()
    raise
  finally:
    if state_lock is not None:
      state_lock.release()
    lock.release()
    birth.remove_empty()  # Folders made only for the locks (e.g. nothing to do).


def _train(cfg: RunConfig, birth: rundir.Birth, *, devices: Sequence[jax.Device] | None,
           stream: TextIO | None) -> Summary:
  stream = stream if stream is not None else sys.stderr
  # A bad mesh is named before the default corpus is prepared. The checkpoint to resume
  # is known before the run is built: a disk tier's state is then built without a first
  # generation of files, which the restore writes or links.
  trainer_lib.check_mesh(cfg, devices)
  dataset_dir = trainer_lib.dataset_dir_for(cfg.data)
  run_id = resume_lib.identity(cfg, dataset_dir, data_lib.load_meta(dataset_dir))
  latest, verified, skipped = resume_lib.resume_point(cfg, run_id)
  trainer = trainer_lib.build(cfg, devices=devices, restoring=latest is not None)
  resume_lib.check_packing(cfg, latest, trainer.opt_state)
  schedule = step_lib.make_schedule(cfg.optim, cfg.train.steps)
  sampler = trainer.train_sampler()
  if latest is None and cfg.model.from_hf is not None and not trainer.started_from_hf:
    # Every checkpoint was damaged: the run starts again, from the weights it began with.
    del trainer
    trainer = trainer_lib.build(cfg, devices=devices, from_hf=True)
    sampler = trainer.train_sampler()
  if latest is not None and latest >= cfg.train.steps and not skipped:
    print(f'nothing to do: the run is already at step {latest}', file=stream)
    return Summary(start_step=latest, final_step=latest, final_loss=math.nan, eval_loss=None,
                   seconds=0.0, tokens_per_s=math.nan, step_s=math.nan, update_s=math.nan,
                   split_steps=0, interrupted=False)
  # From here on the run writes: its directory, resolved config, metrics, checkpoints.
  checkpointer = _open_run_dir(cfg, birth, stream)
  step = resume_lib.restore(cfg, checkpointer, trainer, sampler, latest=latest,
                            verified=verified, skipped=skipped, stream=stream)
  try:
    run = _Run(cfg, trainer, sampler, checkpointer, schedule, run_id, step=step,
               last_saved=latest, stream=stream)
  except BaseException:  # A tracker that could not start (e.g. wandb without a server).
    checkpointer.close()
    raise
  summary = run.train(birth)
  # A run stopped by a non-finite value fails (exit 1): its line reads as the CLI's errors.
  prefix = 'dos-jax: error: ' if summary.nonfinite_step is not None else ''
  print(prefix + summary.line(), file=stream)
  return summary


def _open_run_dir(cfg: RunConfig, birth: rundir.Birth, stream: TextIO) -> ckpt_lib.Checkpointer:
  """Makes the run directory, writes the resolved config and opens the checkpoints. In a
  multi-process run (dos_jax.train.distributed) every process trains and saves jointly,
  but only process 0 writes the config and the metrics."""
  try:
    os.makedirs(cfg.train.out_dir, exist_ok=True)
    if jax.process_index() == 0:
      with open(os.path.join(cfg.train.out_dir, 'config.yaml'), 'w', encoding='utf-8') as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    checkpointer = ckpt_lib.Checkpointer(
        cfg.checkpoint_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save
    )
  except OSError as err:
    birth.undo()
    raise rundir.created_error(err, cfg) from None
  where = os.path.abspath(cfg.train.out_dir)
  elsewhere = '' if os.path.abspath(cfg.checkpoint_dir).startswith(where + os.sep) else (
      f', checkpoints in {os.path.abspath(cfg.checkpoint_dir)}')
  tracked = ', '.join(_TRACKER_OUTPUT[name].format(metrics=cfg.train.metrics_file)
                      for name in cfg.track.trackers)
  print(f'run directory: {where} (config.yaml, {tracked}{elsewhere})', file=stream)
  return checkpointer


_TRACKER_OUTPUT = {'jsonl': '{metrics}', 'tensorboard': trackers_lib.TENSORBOARD_DIR + '/',
                   'wandb': trackers_lib.WANDB_DIR + '/'}


@dataclasses.dataclass
class _Timing:
  """The times of a run's steps; a step that compiled (the first ones) times the
  compiler, so only the others count."""

  steps: int = 0  # Steps that did not compile, and their time.
  total: float = 0.0
  updates: int = 0  # Split steps among them, and their update-phase time.
  update: float = 0.0
  split_steps: int = 0  # Every split step, compiled or not.
  last_update_s: float = math.nan  # The latest measured update phase, for the progress line.

  def add(self, result, *, traced: bool = False) -> None:
    """Counts a step; one that compiled or ran under the profiler is not timed."""
    if result.split:
      self.split_steps += 1
      self.last_update_s = result.update_s
    if not result.compiled and not traced:
      self.steps += 1
      self.total += result.step_s
      if result.split:
        self.updates += 1
        self.update += result.update_s


class _Run:
  """The step loop of a run set up and resumed by `_train`, and its end: the last
  evaluation and checkpoint, the summary, and closing what it opened."""

  def __init__(self, cfg: RunConfig, trainer, sampler, checkpointer: ckpt_lib.Checkpointer,
               schedule, run_id: dict, *, step: int, last_saved: int | None, stream: TextIO):
    self.cfg, self.trainer, self.sampler = cfg, trainer, sampler
    self.checkpointer, self.schedule, self.run_id = checkpointer, schedule, run_id
    # Adaptive policies (the cost model's Auto) choose each step's plan from measured
    # update times; for fixed ones the plan stays None and the optimizer applies its own.
    self.placement = placement_lib.PlanDriver(cfg.offload.placement, trainer.opt_state)
    # Records past the resumed step belong to work that was lost: they are dropped, and a
    # marker record says where the metrics continue (see MetricsLog and trackers). Only
    # process 0 writes them.
    self.metrics = trackers_lib.open_trackers(cfg, resume_step=step,
                                              process_index=jax.process_index())
    self.trace = step_trace.StepTrace(cfg, process_index=jax.process_index())
    self.progress = Progress(cfg.train.steps, start_step=step, every=cfg.train.log_every,
                             stream=stream)
    self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    self.start_step, self.step, self.last_saved = step, step, last_saved
    self.loss, self.eval_loss, self.bad = math.nan, None, None
    self.timing = _Timing()
    # Steps whose clip factor was not 1: early host calls redo their speculated update on
    # those (dos_jax.step.early_calls); every `optimizer.REPLAN_EVERY` steps the measured
    # rate chooses the early calls again (a retrace when they change).
    self.clip_norm = cfg.optim.clip_norm
    self.speculating = (self.clip_norm is not None
                        and optimizer_lib.speculates(trainer.opt_state))
    self.rollbacks, self.signum = 0, None
    self.started = time.perf_counter()

  def train(self, birth: rundir.Birth) -> Summary:
    """Runs the steps and the end of the run; closes the checkpointer and the metrics
    whatever happens, and undoes `birth` when the run fails before any checkpoint."""
    succeeded = False
    try:
      self._steps()
      summary = self._finish()
      succeeded = True
    finally:
      line = self.trace.stop(self.step)  # A run that stopped inside the traced steps.
      if line is not None:
        self.progress.message(line)
      self.progress.close()
      try:
        self.checkpointer.close()
      finally:
        self.metrics.close()
        # A run that dies before its first checkpoint (e.g. out of memory at step 1)
        # leaves nothing half-made behind.
        if not succeeded and self.last_saved is None:
          birth.undo()
    return summary

  def _logged(self, at_step: int) -> bool:
    return (at_step % self.cfg.train.log_every == 0
            or at_step in (self.start_step + 1, self.cfg.train.steps))

  def _split(self, at_step: int) -> bool:
    """Whether step `at_step` runs as two programs, to time its update phase (see
    `step_lib`): when its metrics are logged (or every `split_every`-th step), and
    whenever the placement policy asks for a measurement."""
    every = self.cfg.train.split_every
    due = self._logged(at_step) if every is None else every > 0 and at_step % every == 0
    return due or self.placement.wants_measurement()

  def _save(self, at_step: int) -> bool:
    """Saves a checkpoint of `at_step`; False (and `self.bad`) when the params are not
    finite."""
    try:
      self.checkpointer.save(
          at_step, params=self.trainer.params, opt_state=self.trainer.opt_state,
          meta={'step': at_step, 'sampler': self.sampler.state(), 'seed': self.cfg.train.seed},
          run=self.run_id,
      )
    except ckpt_lib.NonFiniteState:
      self.bad = _NonFinite(at_step, 'the parameters after the update')
      return False
    self.last_saved = at_step
    return True

  def _evaluate(self) -> None:
    self.eval_loss = self.trainer.evaluate(self.cfg.train.eval_batches)
    self.metrics.write({'step': self.step, 'eval_loss': self.eval_loss, 'time': time.time()})

  def _steps(self) -> None:
    """Runs steps until the last, a stop request (`self.signum`) or a non-finite value."""
    with _StopFlag() as stop:
      while self.step < self.cfg.train.steps:
        if stop.requested:
          self.signum = stop.signum
          break
        if not self._one_step():
          break

  def _one_step(self) -> bool:
    """Runs one step and records it; False when the run must stop (`self.bad`)."""
    cfg = self.cfg
    step = self.step + 1
    traced = self.trace.traced(step)
    self.trace.before(step)
    with self.trace.annotate(step):
      result = self.trainer.step(next(self.sampler), plan=self.placement.plan,
                                 split=self._split(step))
    traced_line = self.trace.after(step)
    self.step = step
    # A traced step's times include the profiler's work: no policy learns from them.
    placement_metrics = self.placement.observe(step, None if traced else result.update_s)
    self.loss = result.loss
    self.timing.add(result, traced=traced)
    self.progress.update(
        step, loss=self.loss, tokens_per_s=self.tokens_per_step / result.step_s,
        step_s=result.step_s, update_s=self.timing.last_update_s,
        compiled=result.compiled or traced,
    )
    if traced_line is not None:
      self.progress.message(traced_line)
    finite = math.isfinite(self.loss) and math.isfinite(result.grad_norm)
    speculation = self._speculation(result)
    moved = {'migrate_s': result.migrate_s} if result.migrate_s else {}
    if moved:  # A plan change: rare, so always on record.
      self.progress.message(f'step {step}: state moved to the new plan in'
                            f' {result.migrate_s:.3f} s')
    if self._logged(step) or not finite or moved or traced:
      # grad_s and update_s are null on a fused step (no phases of its own).
      self.metrics.write({
          'step': step, 'loss': self.loss, 'grad_norm': result.grad_norm,
          'lr': float(self.schedule(step - 1)),
          'tokens_per_s': self.tokens_per_step / result.step_s,
          'step_s': result.step_s, 'split': result.split, 'grad_s': result.grad_s,
          'update_s': result.update_s, 'time': time.time(), **placement_metrics,
          **speculation, **moved, **({'profiled': True} if traced else {}),
      })
    if not finite:  # The params now hold the bad update: never save them.
      self.bad = _NonFinite(step, f'loss {self.loss}, grad_norm {result.grad_norm}')
      return False
    if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
      self._evaluate()
      self.progress.message(f'step {step}: eval loss {self.eval_loss:.4f}')
    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
      return self._save(step)
    return True

  def _speculation(self, result) -> dict:
    """The rollbacks so far, for the metrics ({} where the step does not speculate); the
    early calls chosen again every `optimizer.REPLAN_EVERY` steps."""
    if not self.speculating:
      return {}
    self.rollbacks += not result.grad_norm < self.clip_norm
    ran = self.step - self.start_step
    if ran % optimizer_lib.REPLAN_EVERY == 0:
      self.trainer.opt_state = optimizer_lib.replan_early(
          self.cfg, self.trainer.opt_state, self.trainer.mesh.size, self.rollbacks, ran)
    return {'offload/rollbacks': self.rollbacks}

  def _finish(self) -> Summary:
    """The end of the loop: the last evaluation and checkpoint (unless a value was not
    finite), and the summary, also written to the metrics."""
    self.progress.close()
    if self.bad is None and self.step > self.start_step and self.signum is None:
      self._evaluate()
    if self.bad is None and self.last_saved != self.step:
      self._save(self.step)
    self.checkpointer.wait()
    timing, bad = self.timing, self.bad
    summary = Summary(
        start_step=self.start_step, final_step=self.step, final_loss=self.loss,
        eval_loss=self.eval_loss, seconds=time.perf_counter() - self.started,
        tokens_per_s=(self.tokens_per_step * timing.steps / timing.total if timing.total
                      else math.nan),
        step_s=timing.total / timing.steps if timing.steps else math.nan,
        update_s=timing.update / timing.updates if timing.updates else math.nan,
        split_steps=timing.split_steps, interrupted=self.signum is not None,
        signal=self.signum, nonfinite_step=None if bad is None else bad.step,
        nonfinite_what=None if bad is None else bad.what, last_checkpoint=self.last_saved,
    )
    if self.step > self.start_step or self.signum is not None:
      self.metrics.write({'summary': True, **dataclasses.asdict(summary)})
    return summary


@dataclasses.dataclass(frozen=True)
class _NonFinite:
  step: int
  what: str
