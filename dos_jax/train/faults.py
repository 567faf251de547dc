"""Faults of the machine named for what they are, in one line; details in a log file.

Orbax and tensorstore report a failed write as `RESOURCE_EXHAUSTED`, the status XLA
uses for running out of device or host memory, so the text alone does not tell a full
disk from a full GPU. `classify` looks through the error and its causes for the OS's
own code (ENOSPC, EROFS, EACCES, as an `OSError` or as tensorstore's
`[os_error_code='28']`) before it calls anything out of memory, and `describe` turns
the fault into the line the CLI prints: the cause, the folder, the setting that helps,
and where the newest complete checkpoint is. `RunLog` keeps library tracebacks (orbax
logs each failed write several times over) off the terminal and writes them, with the
error's own traceback, to `error.log` in the run folder.
"""

from __future__ import annotations

import enum
import errno
import gc
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

from dos_jax.train import checkpoint as ckpt_lib
from dos_jax.train import integrity

LOG_FILE = 'error.log'


class Fault(enum.Enum):
  NO_SPACE = 'no space'
  READ_ONLY = 'read-only file system'
  PERMISSION = 'permission denied'
  OUT_OF_MEMORY = 'out of memory'


_CODES = {errno.ENOSPC: Fault.NO_SPACE, errno.EDQUOT: Fault.NO_SPACE,
          errno.EROFS: Fault.READ_ONLY, errno.EACCES: Fault.PERMISSION,
          errno.EPERM: Fault.PERMISSION}
_TEXTS = (('No space left on device', Fault.NO_SPACE), ('Disk quota exceeded', Fault.NO_SPACE),
          ('Read-only file system', Fault.READ_ONLY), ('Permission denied', Fault.PERMISSION))


def _chain(err: BaseException) -> list[BaseException]:
  """`err` and its causes (`raise ... from`, and the exceptions it was raised during)."""
  seen, todo = [], [err]
  while todo:
    item = todo.pop(0)
    if item is None or any(item is s for s in seen):
      continue
    seen.append(item)
    todo += [item.__cause__, item.__context__]
  return seen


def classify(err: BaseException) -> Fault | None:
  """The machine fault behind `err`, or None for anything else.

  Example:
    >>> classify(OSError(28, 'No space left on device'))
    <Fault.NO_SPACE: 'no space'>
    >>> classify(ValueError('RESOURCE_EXHAUSTED: Error writing "x": Failed to write 8'
    ...                     " bytes to file 5: No space left on device [os_error_code='28']"))
    <Fault.NO_SPACE: 'no space'>
    >>> classify(RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 15.4GiB.'))
    <Fault.OUT_OF_MEMORY: 'out of memory'>
  """
  chain = _chain(err)
  for item in chain:
    if isinstance(item, OSError) and item.errno in _CODES:
      return _CODES[item.errno]
  for item in chain:
    text = str(item)
    for code in re.findall(r"os_error_code='?(\d+)", text):
      if int(code) in _CODES:
        return _CODES[int(code)]
    for words, fault in _TEXTS:
      if words in text:
        return fault
  for item in chain:
    if isinstance(item, MemoryError) or 'RESOURCE_EXHAUSTED' in str(item):
      return Fault.OUT_OF_MEMORY
  return None


def _size(n: float) -> str:
  for unit in ('bytes', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'bytes' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n}'


def _free_bytes(path: str) -> int | None:
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path or '.').free
  except OSError:
    return None


def last_complete(checkpoint_dir: str) -> str:
  """Where a rerun resumes: 'the last complete checkpoint is <dir>/<step>', from the
  listing and manifests (not re-hashed: that is the next start's job)."""
  steps = [s for s in ckpt_lib.step_dirs(checkpoint_dir)
           if integrity.has_manifest(os.path.join(checkpoint_dir, str(s)))]
  if not steps:
    return 'no checkpoint was saved, so a rerun starts from step 0'
  return f'the last complete checkpoint is {os.path.join(checkpoint_dir, str(steps[-1]))}'


def _culprit_path(err: BaseException, fallback: str) -> str:
  """The file or folder the failed write named (an OSError's filename, or the first
  quoted path in tensorstore's message), else `fallback`."""
  for item in _chain(err):
    if isinstance(item, OSError) and item.filename:
      return os.fspath(item.filename)
  for item in _chain(err):
    found = re.findall(r'"(/[^"]+)"', str(item))
    if found:
      return found[-1]
  return fallback


def describe(err: BaseException, cfg: Any) -> str | None:
  """The one line for a machine fault during the run `cfg`, or None if `err` is not one
  (the caller re-raises it)."""
  fault = classify(err)
  failed = next((e for e in _chain(err) if isinstance(e, ckpt_lib.SaveFailed)), None)
  ckpt_dir = os.path.abspath(cfg.checkpoint_dir)
  where = last_complete(ckpt_dir)
  what = f'writing checkpoint {failed.step}' if failed is not None else 'writing the run'
  removed = ('; its incomplete files were removed' if failed is not None and failed.removed
             else '')
  if fault is Fault.NO_SPACE:
    folder = failed.directory if failed is not None else os.path.dirname(
        _culprit_path(err, ckpt_dir))
    free = _free_bytes(folder)
    free_text = 'unknown' if free is None else _size(free)
    if failed is not None and failed.needed_bytes:
      keep = cfg.checkpoint.keep
      need = (f'; a checkpoint needs about {_size(failed.needed_bytes)} and'
              f' checkpoint.keep={keep} holds {keep + 1} while one is saved'
              f' (about {_size((keep + 1) * failed.needed_bytes)})')
    else:
      need = ''
    return (f'no space left on the device of {folder} while {what}: {free_text} free'
            f'{need}{removed}; free space, lower checkpoint.keep or set checkpoint.dir'
            f' (now {ckpt_dir}) to a larger disk; {where}')
  if fault in (Fault.READ_ONLY, Fault.PERMISSION):
    path = failed.directory if failed is not None else _culprit_path(err, ckpt_dir)
    cause = 'is on a read-only file system' if fault is Fault.READ_ONLY else (
        'cannot be written (permission denied)')
    return (f'{path} {cause} ({what}){removed}; make it writable or set train.out_dir'
            f' and checkpoint.dir (now {ckpt_dir}) to a writable folder; {where}')
  if fault is Fault.OUT_OF_MEMORY and failed is None:
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return (f'out of memory ({first[:200]}); try a smaller model, batch or sequence,'
            f' model.remat=true or more devices; {where}')
  if failed is not None:
    cause = failed.__cause__ if failed.__cause__ is not None else failed
    text = str(cause).strip()
    first = text.splitlines()[0][:200] if text else type(cause).__name__
    return f'{failed} ({first}){removed}; {where}'
  return None


class _Records(logging.Handler):

  def __init__(self):
    super().__init__(logging.WARNING)
    self.lines: list[str] = []
    self.setFormatter(logging.Formatter('%(levelname)s:%(name)s:%(message)s'))

  def emit(self, record: logging.LogRecord) -> None:
    self.lines.append(self.format(record))


class RunLog:
  """While a run trains: orbax's (absl's) warnings and errors, and exceptions Python
  could not raise (tensorstore callbacks after a failed write), are kept instead of
  printed. `write` puts them, with an error's traceback, into the run folder's
  `error.log`; on leaving without `write` they are printed as before. Leaving collects
  garbage first: the asyncio tasks of a failed save report their exceptions when they
  are collected, and are then reported here (appended to the log `write` wrote), not
  at exit nor in a later run of the same process. With `debug=True` nothing is kept
  back.

  Example:
    >>> import logging
    >>> with RunLog() as log:
    ...   logging.getLogger('absl').warning('kept back')
    ...   log.lines()
    ['WARNING:absl:kept back']
  """

  LOGGERS = ('absl', 'asyncio')

  def __init__(self, *, debug: bool = False):
    self.debug = debug
    self._handler = _Records()
    self._saved: list[tuple[logging.Logger, bool]] = []
    self._unraisable = None
    self._written = False
    self._log: tuple[str, int] | None = None  # (path written, records in it)

  def lines(self) -> list[str]:
    return list(self._handler.lines)

  def __enter__(self):
    if self.debug:
      return self
    for name in self.LOGGERS:
      logger = logging.getLogger(name)
      self._saved.append((logger, logger.propagate))
      logger.addHandler(self._handler)
      logger.propagate = False
    self._unraisable = sys.unraisablehook
    sys.unraisablehook = self._keep_unraisable
    return self

  def _keep_unraisable(self, unraisable) -> None:
    text = ''.join(traceback.format_exception(
        unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
    self._handler.lines.append(f'unraisable exception ({unraisable.err_msg}):\n{text}')

  def __exit__(self, *exc):
    if self._saved:
      gc.collect()
      self._append_late_records()
    for logger, propagate in self._saved:
      logger.removeHandler(self._handler)
      logger.propagate = propagate
    self._saved.clear()
    if self._unraisable is not None:
      sys.unraisablehook, self._unraisable = self._unraisable, None
    if not self._written and self._handler.lines:
      print('\n'.join(self._handler.lines), file=sys.stderr)
    self._handler.lines.clear()

  def write(self, err: BaseException, out_dir: str) -> str:
    """Appends the kept records and `err`'s traceback to `<out_dir>/error.log` (to a
    file in the temporary folder when the run folder is gone or cannot be written);
    returns its path."""
    text = ''.join([
        f'--- {time.strftime("%Y-%m-%d %H:%M:%S")} pid {os.getpid()}: dos-jax train failed\n',
        *(line + '\n' for line in self._handler.lines),
        ''.join(traceback.format_exception(err)),
    ])
    self._written = True
    candidates = [os.path.join(out_dir, LOG_FILE)] if os.path.isdir(out_dir) else []
    candidates.append(os.path.join(tempfile.gettempdir(), f'dos-jax-error-{os.getpid()}.log'))
    for path in candidates:
      try:
        with open(path, 'a', encoding='utf-8') as f:
          f.write(text)
        self._log = (path, len(self._handler.lines))
        return path
      except OSError:
        continue
    return '(no log: nowhere could be written)'

  def _append_late_records(self) -> None:
    """The records kept after `write` (a failed save's tasks, collected), to its log."""
    if self._log is None or len(self._handler.lines) <= self._log[1]:
      return
    path, written = self._log
    try:
      with open(path, 'a', encoding='utf-8') as f:
        f.write(''.join(line + '\n' for line in self._handler.lines[written:]))
    except OSError:
      pass
