"""What a run reports: a progress line on stderr and metrics as JSON lines.

The progress line is a plain carriage-return bar on a terminal (one line per
`log_every` steps otherwise, so logs stay readable); no extra dependency is needed.
Metrics go to `<out_dir>/metrics.jsonl`, one JSON object per line, appended across
resumes so a restarted run continues the same file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  seconds = int(round(seconds))
  if seconds < 60:
    return f'{seconds}s'
  minutes, seconds = divmod(seconds, 60)
  if minutes < 60:
    return f'{minutes}m{seconds:02d}s'
  hours, minutes = divmod(minutes, 60)
  return f'{hours}h{minutes:02d}m'


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:.1f} ms' if math.isfinite(seconds) else '- ms'


def rate(tokens_per_s: float) -> str:
  """Tokens per second for a person: `1.23M`, `4.5k`, `812`, and two digits below 10
  (`0.41`: a big model's step on a CPU takes a minute)."""
  if not math.isfinite(tokens_per_s):
    return '-'
  if tokens_per_s >= 1e6:
    return f'{tokens_per_s / 1e6:.2f}M'
  if tokens_per_s >= 1e3:
    return f'{tokens_per_s / 1e3:.1f}k'
  if tokens_per_s >= 10:
    return f'{tokens_per_s:.0f}'
  return f'{tokens_per_s:.2g}'


class Progress:
  """A one-line progress bar: step, loss, tokens/s, step time and update-phase time."""

  def __init__(
      self, total_steps: int, *, start_step: int = 0, every: int = 1,
      stream: TextIO | None = None, width: int = 20,
  ):
    self._stream = stream if stream is not None else sys.stderr
    self._tty = bool(getattr(self._stream, 'isatty', lambda: False)())
    self._total = total_steps
    self._start_step = start_step
    self._every = every
    self._width = width
    self._open_line = False
    self._timed_steps = 0
    self._timed_s = 0.0

  def update(
      self, step: int, *, loss: float, tokens_per_s: float, step_s: float, update_s: float,
      compiled: bool = False,
  ) -> None:
    """Redraws the bar after `step` steps (on a terminal) or prints every `every` steps.

    `update_s` is the latest measured update phase (measured on split steps only; NaN
    before the first), so it may be older than `step`. The ETA is the mean time of the
    steps that did not compile (`compiled` False) times the steps left, so compiling
    the first steps does not inflate it ('?' until such a step has run).
    """
    if not compiled:
      self._timed_steps += 1
      self._timed_s += step_s
    if not self._tty and step % self._every and step not in (self._start_step + 1, self._total):
      return
    done = step / self._total
    filled = int(done * self._width)
    bar = '#' * filled + '.' * (self._width - filled)
    eta = (self._timed_s / self._timed_steps * (self._total - step) if self._timed_steps
           else float('nan'))
    line = (
        f'[{bar}] {step}/{self._total} loss {loss:.4f} | {rate(tokens_per_s)} tok/s'
        f' | step {step_s * 1e3:.0f} ms (update {_ms(update_s)}) | eta {_duration(eta)}'
    )
    if self._tty:
      self._stream.write('\r' + line + '\x1b[K')
      self._open_line = True
    else:
      self._stream.write(line + '\n')
    self._stream.flush()

  def message(self, text: str) -> None:
    """Prints a full line (an eval result, a checkpoint) without breaking the bar."""
    if self._open_line:
      self._stream.write('\n')
      self._open_line = False
    self._stream.write(text + '\n')
    self._stream.flush()

  def close(self) -> None:
    if self._open_line:
      self._stream.write('\n')
      self._open_line = False
    self._stream.flush()


class MetricsLog:
  """Appends one JSON object per line; floats rounded for readability, NaN kept as null.

  A run that resumes from step N passes `resume_step=N`: records of later steps (work
  done after the checkpoint and lost with the process) are cut off the end of the file
  (truncated in place: the file is only ever appended to or cut back, never rewritten),
  and a marker record `{"resumed_from": N, "time": ...}` is appended, so each step
  appears once and the file says where it was resumed. A fresh run (N = 0) drops the
  records of an earlier attempt that saved no checkpoint.
  """

  def __init__(self, path: str, *, resume_step: int | None = None):
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    if resume_step is not None and os.path.isfile(path):
      _truncate_after(path, resume_step)
    self._file = open(path, 'a', encoding='utf-8')  # pylint: disable=consider-using-with
    if resume_step:
      self.write({'resumed_from': resume_step, 'time': time.time()})

  def write(self, record: dict[str, Any]) -> None:
    self._file.write(json.dumps(clean(record), sort_keys=False) + '\n')
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def _record_step(record: dict[str, Any]) -> int | None:
  for key in ('step', 'final_step', 'resumed_from'):
    if isinstance(record.get(key), int):
      return record[key]
  return None


def _truncate_after(path: str, step: int) -> None:
  """Cuts `path` back to the end of the last record before the first one of a step after
  `step` (or the first unreadable line: a record cut short by a kill). Records are in
  step order, since every resume cuts the file back to its checkpoint first."""
  keep, newline = 0, True
  with open(path, 'rb') as f:
    for raw in f:
      try:
        record = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError):
        if not raw.strip():
          keep += len(raw)
          continue
        break
      at = _record_step(record) if isinstance(record, dict) else None
      if at is not None and at > step:
        break
      keep += len(raw)
      newline = raw.endswith(b'\n')
  if keep < os.path.getsize(path):
    os.truncate(path, keep)
  if not newline:  # A whole last record without its newline: finish the line.
    with open(path, 'ab') as f:
      f.write(b'\n')


def clean(record: dict[str, Any]) -> dict[str, Any]:
  """A record as `metrics.jsonl` holds it: numbers as floats (non-finite ones as None),
  ints, bools, strings and None as they are, anything else as its text."""
  return {k: _jsonable(v) for k, v in record.items()}


def _jsonable(value: Any) -> Any:
  if isinstance(value, (bool, int, str)) or value is None:
    return value
  try:
    number = float(value)
  except (TypeError, ValueError):
    return str(value)
  return number if math.isfinite(number) else None


def read_metrics(path: str) -> list[dict[str, Any]]:
  """All records of a metrics file, oldest first."""
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]
