"""The run's compiled programs kept on disk: JAX's persistent compilation cache.

A resumed, restarted or repeated run compiles the same programs again: on the
packaged tiny config that is 12 of a 20-second run on a 2-core CPU. `enable` points
JAX's persistent compilation cache at `<dos_jax cache>/jax` (`dos_jax.cache_dir`) and
keeps every program, small ones too, so the next run loads them (`train.compilation_cache:
false` turns it off). A cache the user has set up for JAX (`JAX_COMPILATION_CACHE_DIR`,
`jax.config`) is left as it is. JAX writes from process 0 only; a program whose entry
cannot be read (a run killed while writing it) is compiled again, with JAX's warning.

Example:

    >>> from dos_jax.train import compile_cache
    >>> folder = compile_cache.enable(True)  # before the run's first compile
"""

from __future__ import annotations

import jax

import dos_jax


def enable(on: bool) -> str | None:
  """Sets JAX's persistent compilation cache for this process's run (`on`:
  `train.compilation_cache`), before its first compile; returns the folder in use
  (None: none). A folder already set for JAX is kept, whatever `on` says."""
  current = jax.config.jax_compilation_cache_dir
  if current or not on:
    return current or None
  folder = str(dos_jax.cache_dir('jax'))
  use(folder)
  return folder


def use(folder: str) -> None:
  """JAX's persistent compilation cache in `folder`, keeping every program: the
  runner's small ones (parameter init, checkpoint conversion) together take as long to
  compile as its step on the tiny config."""
  jax.config.update('jax_compilation_cache_dir', folder)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
