"""The run directory: checked before the run writes, removed if the run dies unborn.

`check` turns the mistakes that would otherwise surface as tracebacks half-way into a
run (an output folder that cannot be written, a path that is a file) into one-line
`ConfigError`s, before anything is written. `Birth` records which of the run's paths
existed before it started, so that a run that fails before its first checkpoint (out
of memory at the first step, say) removes what it made and leaves no half-made folder.
"""

from __future__ import annotations

import os
import shutil

from dos_jax.train.configlib import ConfigError


def _nearest_existing(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def _check_dir(key: str, path: str) -> None:
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'{key}: {path} exists and is not a directory')
  base = _nearest_existing(path)
  if not os.path.isdir(base):
    raise ConfigError(f'{key}: {path} cannot be created: {base} is not a directory')
  if not os.access(base, os.W_OK | os.X_OK):
    raise ConfigError(f'{key}: {path} cannot be written (no write permission on {base})')


def check(cfg) -> None:
  """Raises ConfigError naming the key if the run's outputs cannot be written."""
  _check_dir('train.out_dir', cfg.train.out_dir)
  _check_dir('checkpoint.dir', cfg.checkpoint_dir)
  if os.path.isdir(cfg.metrics_path):
    raise ConfigError(f'train.metrics_file: {cfg.metrics_path} is a directory')


class Birth:
  """Remembers which of a run's paths are new, to remove them if the run fails early."""

  def __init__(self, cfg):
    self._paths = [cfg.checkpoint_dir, cfg.train.out_dir,
                   os.path.join(cfg.train.out_dir, 'config.yaml'), cfg.metrics_path]
    self._new = [p for p in self._paths if not os.path.exists(p)]

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
