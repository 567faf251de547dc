"""A `jax.profiler` trace of the steps `track.profile_steps` names.

The loop asks `StepTrace` before and after each step: the trace starts before the
first traced step's programs run and stops after the last one's, so evaluations and
checkpoints outside those steps are not in it, and the loop leaves the traced steps
out of its step times. Each step runs inside a `jax.profiler.StepTraceAnnotation`
('train', step_num=N), the mark TensorBoard's profile plugin (xprof) splits steps by.
The trace goes to `<out_dir>/profile/plugins/profile/<time>/<host>.xplane.pb` (xprof,
TensorBoard's profile plugin) with a `<host>.trace.json.gz` beside it (Perfetto);
process i > 0 of a multi-process run writes under `profile/process<i>`. How to read
it: docs/runner.md.

Example:
  >>> import glob, tempfile
  >>> import jax.numpy as jnp
  >>> from dos_jax.train import config
  >>> folder = tempfile.mkdtemp()
  >>> cfg = config.load(None, [f'train.out_dir={folder}', 'track.profile_steps=[2, 2]'])
  >>> trace, lines = StepTrace(cfg), []
  >>> for step in (1, 2, 3):
  ...   trace.before(step)
  ...   with trace.annotate(step):
  ...     _ = (jnp.ones(4) * step).block_until_ready()
  ...   lines.append(trace.after(step))
  >>> lines == [None, f'step 2: profiler trace in {folder}/profile', None]
  True
  >>> [trace.traced(s) for s in (1, 2, 3)], len(glob.glob(f'{folder}/profile/**/*.xplane.pb',
  ...                                                      recursive=True))
  ([False, True, False], 1)
"""

from __future__ import annotations

import contextlib
import os

import jax

PROFILE_DIR = 'profile'


class StepTrace:
  """Starts and stops the profiler around the steps of `cfg.track.profile_steps`."""

  def __init__(self, cfg, *, process_index: int = 0):
    self.steps = cfg.track.profiled
    folder = os.path.join(cfg.train.out_dir, PROFILE_DIR)
    self.folder = folder if process_index == 0 else os.path.join(folder,
                                                                 f'process{process_index}')
    self._active = False
    self.first: int | None = None  # The first step this run traced.

  def traced(self, step: int) -> bool:
    return step in self.steps

  def annotate(self, step: int):
    """The step's mark in the trace (nothing outside the traced steps)."""
    if not self._active:
      return contextlib.nullcontext()
    return jax.profiler.StepTraceAnnotation('train', step_num=step)

  def before(self, step: int) -> None:
    if self.traced(step) and not self._active:
      os.makedirs(self.folder, exist_ok=True)
      jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
      self._active, self.first = True, step

  def after(self, step: int) -> str | None:
    """Stops the trace after its last step; returns the line saying where it is."""
    if self._active and step >= self.steps[-1]:
      return self.stop(step)
    return None

  def stop(self, step: int) -> str | None:
    """Stops a trace in progress (a run that ends inside the range); idempotent."""
    if not self._active:
      return None
    self._active = False
    jax.profiler.stop_trace()
    steps = f'step {step}' if step == self.first else f'steps {self.first}-{step}'
    return f'{steps}: profiler trace in {self.folder}'
