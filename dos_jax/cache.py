"""The one cache directory of dos_jax: prepared default corpus, machine profiles.

`$DOS_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/dos_jax`, else `~/.cache/dos_jax`.
Each user of the cache takes a subdirectory of its own (`cache_dir('data')`).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = 'DOS_JAX_CACHE_DIR'


def cache_dir(*parts: str) -> Path:
  """The cache root (see the module docstring), or a path under it; not created here."""
  root = os.environ.get(CACHE_DIR_ENV)
  if not root:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    root = os.path.join(base, 'dos_jax')
  return Path(root).joinpath(*parts)


def umask_mode(mode: int = 0o666) -> int:
  """`mode` as the process umask lets a newly created file have it (for files made
  with tempfile, which creates them 0600)."""
  current = os.umask(0)
  os.umask(current)
  return mode & ~current
