"""Test set-up: 8 virtual CPU devices for the sharding tests, the `gpu` marker, one
pytest-xdist worker per core, and one compilation cache for the whole run.

Most of the suite's time is XLA compiling (on the 2-core CPU machine, about two
thirds of a typical test file), and many tests compile the same program from fresh
closures. A persistent compilation cache in a temporary folder, shared by the
workers of one run and removed after it, compiles each such program once. It
changes nothing a test checks: a jitted function's own cache (`_cache_size()`,
optax's `log_compilations`) still sees every trace, and the executables are XLA's
own, stored and loaded. Only this process's JAX uses it: the runs that tests start
as subprocesses (some of them killed mid-step, while JAX writes an entry in place)
never write to it.
"""

import atexit
import os
import shutil
import tempfile

# Must happen before JAX starts a backend. Tests that do not shard use device 0 only.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

_CACHE_ENV = 'DOS_JAX_TEST_COMPILATION_CACHE'


def _gpu_visible() -> bool:
  """A CUDA device this run's JAX would use (without starting a backend to ask)."""
  if os.environ.get('JAX_PLATFORMS', '').strip().lower() == 'cpu':
    return False
  return os.path.exists('/dev/nvidia0')


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: one worker per core, at most 8; none beside a GPU (each worker's JAX
  would take most of its memory)."""
  del config
  if _gpu_visible():
    return 0
  return max(1, min(8, len(os.sched_getaffinity(0))))


def _compilation_cache() -> str:
  """The run's cache folder: made by the first process (pytest's controller) and
  inherited by its workers through the environment; removed when its maker exits."""
  path = os.environ.get(_CACHE_ENV)
  if not path:
    path = tempfile.mkdtemp(prefix='dos_jax-tests-jax-cache-')
    os.environ[_CACHE_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


if not jax.config.jax_compilation_cache_dir:  # a cache the user set is kept
  jax.config.update('jax_compilation_cache_dir', _compilation_cache())
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == 'gpu':
    return
  skip_gpu = pytest.mark.skip(reason='needs a CUDA GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip_gpu)
