"""The run directory: checked before the run writes, removed if the run dies unborn.

`check` turns the mistakes that would otherwise surface as tracebacks half-way into a
run (an output folder that cannot be written, a path that is a file) into one-line
`ConfigError`s, before anything is written. `Birth` records which of the run's paths
existed before it started, so that a run that fails before its first checkpoint (out
of memory at the first step, say) removes what it made and leaves no half-made folder.
`RunLock` makes each run folder, and each disk tier's state folder, one run's: a second
run on it stops at once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time

from dos_jax.train.configlib import ConfigError

LOCK_FILE = 'run.lock'
STATE_LOCK_FILE = 'state.lock'  # in `offload.disk_dir`


def _nearest_existing(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def _outermost_new(path: str) -> str:
  """The highest of `path` and its parents that does not exist yet (`path` if it does)."""
  path = os.path.abspath(path)
  while not os.path.exists(os.path.dirname(path)) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def _check_dir(key: str, path: str) -> None:
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'{key}: {path} exists and is not a directory')
  base = _nearest_existing(path)
  if not os.path.isdir(base):
    raise ConfigError(f'{key}: {path} cannot be created: {base} is not a directory')
  if not os.access(base, os.W_OK | os.X_OK):
    if _read_only(base):
      raise ConfigError(f'{key}: {path} cannot be written ({base} is on a read-only file'
                        ' system)')
    raise ConfigError(f'{key}: {path} cannot be written (no write permission on {base})')


def _read_only(path: str) -> bool:
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def check(cfg) -> None:
  """Raises ConfigError naming the key if the run's outputs cannot be written."""
  _check_dir('train.out_dir', cfg.train.out_dir)
  _check_dir('checkpoint.dir', cfg.checkpoint_dir)
  if cfg.offload.disk_dir is not None:
    _check_dir('offload.disk_dir', cfg.offload.disk_dir)
  if os.path.isdir(cfg.metrics_path):
    raise ConfigError(f'train.metrics_file: {cfg.metrics_path} is a directory')


class Birth:
  """Remembers which of a run's paths are new, to remove them if the run fails early."""

  def __init__(self, cfg):
    self._paths = [cfg.checkpoint_dir, cfg.train.out_dir,
                   os.path.join(cfg.train.out_dir, 'config.yaml'), cfg.metrics_path,
                   _outermost_new(cfg.train.out_dir), _outermost_new(cfg.checkpoint_dir)]
    self._new = [p for p in self._paths if not os.path.exists(p)]
    # A new state folder is only ever removed empty: another run may have made it since.
    disk_dir = cfg.offload.disk_dir
    self._empty_only = ([os.path.abspath(disk_dir)] if disk_dir is not None
                        and not os.path.exists(disk_dir) else [])

  def remove_empty(self) -> None:
    """Removes the directories this run created that are empty (deepest first)."""
    made = {p for p in self._new + self._empty_only if os.path.isdir(p)}
    for path in sorted(made, key=len, reverse=True):
      try:
        os.rmdir(path)
      except OSError:
        pass  # Not empty.

  def undo(self) -> None:
    """Removes the paths this run created: files first, then directories."""
    for path in sorted(self._new, key=lambda p: (os.path.isdir(p), -len(p))):
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      elif os.path.exists(path):
        os.unlink(path)


def created_error(err: OSError, cfg) -> ConfigError:
  """An OSError while creating the run's outputs, as a one-line ConfigError."""
  return ConfigError(
      f'train.out_dir: cannot write {err.filename or cfg.train.out_dir}'
      f' ({err.strerror or type(err).__name__})'
  )


class RunLocked(ConfigError):
  """Another live process holds a folder's lock; `str(err)` names the key, its PID and
  host (and its run folder, for a state folder)."""


class RunLock:
  """An advisory `flock` on `<folder>/<name>`, held while a run writes the folder.

  The kernel drops the lock when its process dies (however it dies), so a killed run
  never blocks the next one. The holder writes its PID, host, start time and run folder
  into the file, which a refused run quotes; the file is removed when the run releases
  it. A file left with a record in it was held by a process that died without
  releasing it: the new holder takes it over and keeps that record in `stale` (None
  otherwise), for the caller to say so. In a multi-process run each process locks its
  own file (`<name>` for process 0, `<name>.<index>` for the others): the processes of
  one run do not block each other, and a second run is refused by whichever of its
  processes meets a held lock (see `loop` for how a refusal stops all processes of
  that run). `key` is the config key the refusal names (`train.out_dir`, or
  `offload.disk_dir` for the disk tier's state folder).

  Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> lock = RunLock(folder)
    >>> try:
    ...   RunLock(folder)
    ... except RunLocked as err:
    ...   print(str(err).split(' is in use')[0] == f'train.out_dir: {folder}')
    True
    >>> lock.release()
  """

  def __init__(self, folder: str, *, process_index: int = 0, key: str = 'train.out_dir',
               name: str = LOCK_FILE, run_dir: str | None = None):
    self.folder = os.path.abspath(folder)
    self.key = key
    name = name if process_index == 0 else f'{name}.{process_index}'
    self.path = os.path.join(self.folder, name)
    os.makedirs(self.folder, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as err:
        os.close(fd)
        if err.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        raise RunLocked(f'{key}: {self.folder} is in use by another run'
                        f' ({_holder(self.path)}); wait for it to end or set another'
                        f' {key}') from None
      # A holder that released (and removed the file) between our open and our lock:
      # the lock is on a file no longer in the folder, so take the folder's new one.
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    self._fd: int | None = fd
    self.stale = _record(os.pread(fd, 4096, 0))
    record = {'pid': os.getpid(), 'host': socket.gethostname(),
              'process_index': process_index, 'since': time.strftime('%Y-%m-%d %H:%M:%S')}
    if run_dir is not None:
      record['run'] = os.path.abspath(run_dir)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + '\n').encode(), 0)

  def taken_over(self) -> str | None:
    """The line saying this lock was taken over from a dead holder (None if it was not)."""
    if self.stale is None:
      return None
    return (f'{self.key}: {self.folder}: took over the lock left by {_describe(self.stale)},'
            ' which ended without releasing it')

  def release(self) -> None:
    """Removes the lock file and drops the lock (idempotent)."""
    if self._fd is None:
      return
    try:
      os.unlink(self.path)  # While still holding it: no one can have locked this file.
    except FileNotFoundError:
      pass
    finally:
      os.close(self._fd)
      self._fd = None


def _record(raw: bytes) -> dict | None:
  try:
    record = json.loads(raw.decode() or 'null')
  except (UnicodeDecodeError, ValueError):
    return None
  return record if isinstance(record, dict) and 'pid' in record else None


def _describe(record: dict) -> str:
  run = f', run {record["run"]}' if record.get('run') else ''
  return (f'pid {record.get("pid")} on host {record.get("host")},'
          f' since {record.get("since")}{run}')


def _holder(path: str) -> str:
  """'pid 123 on host h, since ...' from a held lock file (read again briefly if the
  holder has not written it yet)."""
  for _ in range(20):
    try:
      with open(path, 'rb') as f:
        record = _record(f.read())
    except OSError:
      record = None
    if record is not None:
      return _describe(record)
    time.sleep(0.05)
  return f'its pid and host are not recorded in {path}'


def lock_run(out_dir: str) -> RunLock:
  """Locks the run folder for this run (`run.lock`): see `_lock_every_process`.

  Raises:
    RunLocked: another run holds the folder (names its PID and host).
  """
  return _lock_every_process(out_dir, key='train.out_dir', name=LOCK_FILE)


def lock_state(cfg) -> RunLock | None:
  """Locks the disk tier's state folder (`offload.disk_dir`, `state.lock`) for the run
  of `cfg`, whose run folder the lock file names; None without a disk tier.

  Raises:
    RunLocked: another run holds the state folder (names its PID, host and run folder).
  """
  if cfg.offload.disk_dir is None:
    return None
  return _lock_every_process(cfg.offload.disk_dir, key='offload.disk_dir',
                             name=STATE_LOCK_FILE, run_dir=cfg.train.out_dir)


def _lock_every_process(folder: str, *, key: str, name: str,
                        run_dir: str | None = None) -> RunLock:
  """Locks `folder` for this run: every process its own file, and if any process of a
  multi-process run meets a held lock, all of them stop (RunLocked), so that no
  process of a refused run waits for peers that have left."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  index, count = jax.process_index(), jax.process_count()
  try:
    lock, refused = RunLock(folder, process_index=index, key=key, name=name,
                            run_dir=run_dir), None
  except RunLocked as err:
    lock, refused = None, err
  if count > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    held = np.asarray(multihost_utils.process_allgather(np.array(refused is not None)))
    if refused is None and held.any():
      lock.release()
      refused = RunLocked(
          f'{key}: {os.path.abspath(folder)} is in use by another run (process'
          f' {int(np.argmax(held))} of this run found its lock held)')
  if refused is not None:
    raise refused
  return lock
