"""The training loop: build everything from a `RunConfig`, resume, train, report.

Order matters for the user: everything that can fail because of their input (mesh
sizes, dataset path, batch divisibility) is checked before anything is written, so a
bad run leaves no output directory behind. Ctrl-C stops at the next step boundary,
saves a checkpoint and returns; a second Ctrl-C aborts at once.
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
from dos_jax.train import placement as placement_lib
from dos_jax.train import step as step_lib
from dos_jax.train import trainer as trainer_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import to_dict
from dos_jax.train.progress import MetricsLog, Progress


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
    interrupted: stopped by Ctrl-C (a checkpoint of `final_step` was saved).
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

  def line(self) -> str:
    if self.final_step == self.start_step and not self.interrupted:
      return f'nothing to do: the run is already at step {self.final_step}'
    eval_part = '' if self.eval_loss is None else f', eval loss {self.eval_loss:.4f}'
    verb = 'interrupted at' if self.interrupted else 'finished'
    update = (f'update {self.update_s * 1e3:.1f} ms' if math.isfinite(self.update_s)
              else 'update not measured')
    return (
        f'{verb} step {self.final_step} in {self.seconds:.1f}s: loss {self.final_loss:.4f}'
        f'{eval_part}, {self.tokens_per_s:,.0f} tok/s, step {self.step_s * 1e3:.1f} ms'
        f' ({update})'
    )


class _StopFlag:
  """Turns the first SIGINT into a request to stop at the next step boundary, so that
  donated buffers are never abandoned mid-update; the second SIGINT aborts."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)


def train(
    cfg: RunConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    stream: TextIO | None = None,
) -> Summary:
  """Trains (or resumes) the run `cfg` describes; returns its summary.

  Raises:
    ConfigError: a mistake in `cfg` found against the machine or the files (nothing
      has been written then).
  """
  stream = stream if stream is not None else sys.stderr
  trainer = trainer_lib.build(cfg, devices=devices)
  schedule = step_lib.make_schedule(cfg.optim, cfg.train.steps)
  sampler = trainer.train_sampler()

  # From here on the run writes: its directory, resolved config, metrics, checkpoints.
  os.makedirs(cfg.train.out_dir, exist_ok=True)
  with open(os.path.join(cfg.train.out_dir, 'config.yaml'), 'w', encoding='utf-8') as f:
    yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
  checkpointer = ckpt_lib.Checkpointer(
      cfg.checkpoint_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save
  )
  step = 0
  latest = checkpointer.latest_step()
  if latest is not None:
    restored = checkpointer.restore(
        latest, params=trainer.params, opt_state=trainer.opt_state, tx=trainer.tx
    )
    trainer.set_state(restored.params, restored.opt_state)
    step = restored.step
    sampler.restore(restored.meta['sampler'])
    print(f'resumed from {cfg.checkpoint_dir} at step {step}', file=stream)

  def save(at_step: int) -> None:
    checkpointer.save(
        at_step, params=trainer.params, opt_state=trainer.opt_state,
        meta={'step': at_step, 'sampler': sampler.state(), 'seed': cfg.train.seed},
    )

  # Adaptive policies (the cost model's Auto) choose each step's plan from measured
  # update times; for fixed policies the plan stays None and the optimizer applies its own.
  placement = placement_lib.PlanDriver(cfg.offload.placement, trainer.opt_state)

  def logged(at_step: int) -> bool:
    return at_step % cfg.train.log_every == 0 or at_step in (start_step + 1, cfg.train.steps)

  def split(at_step: int) -> bool:
    """Whether step `at_step` runs as two programs, to time its update phase (see
    `step_lib`): when its metrics are logged (or every `split_every`-th step), and
    whenever the placement policy asks for a measurement."""
    every = cfg.train.split_every
    due = logged(at_step) if every is None else every > 0 and at_step % every == 0
    return due or placement.wants_measurement()

  metrics = MetricsLog(cfg.metrics_path)
  progress = Progress(cfg.train.steps, start_step=step, every=cfg.train.log_every, stream=stream)
  tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
  start_step, last_saved = step, latest
  loss, eval_loss = math.nan, None
  timed_steps, timed_total, timed_updates, timed_update, split_steps = 0, 0.0, 0, 0.0, 0
  last_update_s = math.nan  # The latest measured update phase, for the progress line.
  started = time.perf_counter()
  interrupted = False
  try:
    with _StopFlag() as stop:
      while step < cfg.train.steps:
        if stop.requested:
          interrupted = True
          break
        result = trainer.step(next(sampler), plan=placement.plan, split=split(step + 1))
        step += 1
        placement_metrics = placement.observe(step, result.update_s)
        loss = result.loss
        if result.split:
          split_steps += 1
          last_update_s = result.update_s
        if not result.compiled:  # A step that compiled (the first ones) times the compiler.
          timed_steps += 1
          timed_total += result.step_s
          if result.split:
            timed_updates += 1
            timed_update += result.update_s
        progress.update(
            step, loss=loss, tokens_per_s=tokens_per_step / result.step_s,
            step_s=result.step_s, update_s=last_update_s,
        )
        if logged(step):
          # grad_s and update_s are null on a fused step (no phases of its own).
          metrics.write({
              'step': step, 'loss': loss, 'grad_norm': result.grad_norm,
              'lr': float(schedule(step - 1)), 'tokens_per_s': tokens_per_step / result.step_s,
              'step_s': result.step_s, 'split': result.split, 'grad_s': result.grad_s,
              'update_s': result.update_s, 'time': time.time(), **placement_metrics,
          })
        if not math.isfinite(loss):
          progress.message(f'step {step}: loss is {loss}; stopping')
          break
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
          eval_loss = trainer.evaluate(cfg.train.eval_batches)
          metrics.write({'step': step, 'eval_loss': eval_loss, 'time': time.time()})
          progress.message(f'step {step}: eval loss {eval_loss:.4f}')
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
          save(step)
          last_saved = step
    progress.close()
    if step > start_step and not interrupted:
      eval_loss = trainer.evaluate(cfg.train.eval_batches)
      metrics.write({'step': step, 'eval_loss': eval_loss, 'time': time.time()})
    if last_saved != step:
      save(step)
    summary = Summary(
        start_step=start_step,
        final_step=step,
        final_loss=loss,
        eval_loss=eval_loss,
        seconds=time.perf_counter() - started,
        tokens_per_s=tokens_per_step * timed_steps / timed_total if timed_total else math.nan,
        step_s=timed_total / timed_steps if timed_steps else math.nan,
        update_s=timed_update / timed_updates if timed_updates else math.nan,
        split_steps=split_steps,
        interrupted=interrupted,
    )
    metrics.write({'summary': True, **dataclasses.asdict(summary)})
  finally:
    progress.close()
    checkpointer.close()
    metrics.close()
  print(summary.line(), file=stream)
  return summary
