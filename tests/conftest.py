"""Test set-up: 8 virtual CPU devices for the sharding tests, the `gpu` marker, one
pytest-xdist worker per core, one compilation cache for the whole run (and, with a CUDA
plugin, one XLA GPU kernel cache), and the `seed` fixture that every test drawing random
inputs takes its seed from.

Most of the suite's time is XLA compiling (on the 2-core CPU machine, about two
thirds of a typical test file), and many tests compile the same program from fresh
closures, or start `dos-jax train` again on the same config. A persistent compilation
cache in a temporary folder, shared by the workers of one run and the runs they start
as subprocesses (through JAX's own variables, `JAX_COMPILATION_CACHE_DIR`; the runner
keeps a cache set that way), and removed after it, compiles each such program once.
It changes nothing a test checks: a jitted function's own cache (`_cache_size()`,
optax's `log_compilations`) still sees every trace, and the executables are XLA's
own, stored and loaded. A subprocess killed while JAX writes an entry leaves it short:
JAX then warns and compiles that program again. A test that needs its runs to have a
cache of their own (or none) sets these variables itself.
"""

import atexit
import importlib.metadata
import os
import shutil
import tempfile
import zlib

_CACHE_ENV = 'DOS_JAX_TEST_COMPILATION_CACHE'
_SEED_ENV = 'DOS_JAX_TEST_SEED'


def _compilation_cache() -> str:
  """The run's cache folder: made by the first process (pytest's controller) and
  inherited by its workers through the environment; removed when its maker exits."""
  path = os.environ.get(_CACHE_ENV)
  if not path:
    path = tempfile.mkdtemp(prefix='dos_jax-tests-jax-cache-')
    os.environ[_CACHE_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def _add_xla_flag(flag: str) -> None:
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


# Must happen before JAX starts a backend. Tests that do not shard use device 0 only.
# Flags given in XLA_FLAGS (.ci/run's stage 2 passes some) are kept beside it.
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  _add_xla_flag('--xla_force_host_platform_device_count=8')
# With the CUDA plugin, the compiled-program tests' H100 compiles keep the GPU kernels
# they generate (LLVM and ptxas: about 40% of a compile) in a file per jaxlib version in
# the run's cache folder, which the workers share: a later compile generating a kernel
# of the same fused computation loads it (XLA's `--xla_gpu_kernel_cache_file`; the
# program is scheduled and its buffers assigned before kernels are generated, so
# nothing a test checks changes). XLA writes the file whole, to a temporary file it then
# renames: a worker reads a whole file, and of two writing at once one's kernels stay.
# One flag for every worker (inherited from the controller): JAX's compilation cache
# keys its entries by XLA_FLAGS. A cache file the user names is kept.
# (Importing dos_jax imports jax but starts no backend: XLA reads its flags when one starts.)
from dos_jax.dataflow import compile as _gpu_compile  # pylint: disable=wrong-import-position

if _gpu_compile._cuda_plugin_present() \
    and 'xla_gpu_kernel_cache_file' not in os.environ.get('XLA_FLAGS', ''):  # pylint: disable=protected-access
  _add_xla_flag('--xla_gpu_kernel_cache_file=' + os.path.join(
      _compilation_cache(), f"xla-gpu-kernels-{importlib.metadata.version('jaxlib')}.bin"))

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from dos_jax.train import compile_cache  # pylint: disable=wrong-import-position


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


if not jax.config.jax_compilation_cache_dir:  # a cache the user set is kept
  compile_cache.use(_compilation_cache())
  # The runs tests start as subprocesses (`dos-jax train`, examples) use it too.
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', jax.config.jax_compilation_cache_dir)
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')


def node_ids(path: str) -> frozenset[str]:
  """The node ids a list file names: one a line; blank lines and `#` comments skipped."""
  with open(path, encoding='utf-8') as f:
    return frozenset(line.strip() for line in f
                     if line.strip() and not line.lstrip().startswith('#'))


def _slow_tier() -> frozenset[str]:
  """The node ids tests/slow_tier.txt puts in the `slow` tier (beside the tests marked
  `@pytest.mark.slow` in their files)."""
  return node_ids(os.path.join(os.path.dirname(__file__), 'slow_tier.txt'))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks tests/slow_tier.txt's tests `slow` (before `-m` deselects: tryfirst), the
  known regressions of this JAX a strict xfail, and `gpu` tests skipped without a GPU."""
  del config
  from tests import compiled  # pylint: disable=import-outside-toplevel
  slow = _slow_tier()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  for item in items:
    reason = compiled.KNOWN_REGRESSIONS.get(item.nodeid)
    if reason is not None:
      # A reason, or (reason, the exception the known failure raises).
      reason, raises = reason if isinstance(reason, tuple) else (reason, AssertionError)
      item.add_marker(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
  if jax.default_backend() == 'gpu':
    return
  skip_gpu = pytest.mark.skip(reason='needs a CUDA GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip_gpu)


def pytest_addoption(parser):
  parser.addoption(
      '--leave-out', metavar='FILE', default=None,
      help='deselect the pytest node ids FILE lists, one a line (# starts a comment); '
      'CI stage 2c passes tests/stage_2c_leaves_out.txt')
  parser.addoption(
      '--first-parameter-set', action='store_true',
      help='run each test function once: the first of its parameter sets that the other '
      'options select (and every xfail: the known regressions stay strict). CI runs '
      'every parameter set on jax 0.10 and each function once on the newest jax.')


class _FirstParameterSet:
  """`--first-parameter-set`: deselects all but the first item of each test function,
  after `-m`, `-k` and `--deselect` chose (trylast), so a function whose first
  parameter set is deselected runs with its next one. An item skipped by a marker
  gives way to the next one; every xfail stays (the known regressions among them)."""

  @pytest.hookimpl(trylast=True)
  def pytest_collection_modifyitems(self, config, items):
    first = {}
    for item in items:  # the first item not skipped by a marker, else the first
      name = item.nodeid.split('[', 1)[0]
      if name not in first or (first[name].get_closest_marker('skip') is not None
                               and item.get_closest_marker('skip') is None):
        first[name] = item
    chosen = {id(item) for item in first.values()}
    dropped = [item for item in items
               if id(item) not in chosen and item.get_closest_marker('xfail') is None]
    if dropped:
      config.hook.pytest_deselected(items=dropped)
      gone = {id(item) for item in dropped}
      items[:] = [item for item in items if id(item) not in gone]


class _LeaveOut:
  """`--leave-out FILE`: deselects the node ids FILE lists."""

  def __init__(self, path: str):
    self.ids = node_ids(path)

  def pytest_collection_modifyitems(self, config, items):
    left_out = [item for item in items if item.nodeid in self.ids]
    if left_out:
      config.hook.pytest_deselected(items=left_out)
      items[:] = [item for item in items if item.nodeid not in self.ids]


def pytest_configure(config):
  path = config.getoption('--leave-out')
  if path:
    if not os.path.isfile(path):
      raise pytest.UsageError(f'--leave-out {path}: no such file')
    config.pluginmanager.register(_LeaveOut(path), 'dos_jax_leave_out')
  if config.getoption('--first-parameter-set'):
    config.pluginmanager.register(_FirstParameterSet(), 'dos_jax_first_parameter_set')


@pytest.fixture(autouse=True, scope='session')
def _uncommitted_params_warning_given():
  """Many tests hand `init` freshly made (uncommitted) arrays, which costs one extra
  compile and nothing else; the warning that says so is asserted where it is the
  subject (tests/test_optax_tools.py, which re-arms it). Every other project warning
  is an error (pyproject's `filterwarnings`)."""
  from dos_jax import validate  # pylint: disable=import-outside-toplevel
  validate._uncommitted_warned = True  # pylint: disable=protected-access
  yield


def _seed_of(nodeid: str) -> int:
  start = int(os.environ.get(_SEED_ENV, '0'))
  return zlib.crc32(nodeid.encode(), start) % (1 << 30)


@pytest.fixture
def seed(request) -> int:
  """The seed of this test's random inputs, in [0, 2**30): a hash (CRC-32) of the test's
  id (`<file>::<test>[<params>]`), so a failure reruns with the same inputs, alone
  or in the suite, with or without xdist. `DOS_JAX_TEST_SEED=<int>` starts every hash
  from that int instead of 0, drawing other inputs for the whole run. A failed test's
  report shows its seed in a `seed` section."""
  value = _seed_of(request.node.nodeid)
  request.node.user_properties.append(('seed', value))
  return value


@pytest.fixture(scope='module')
def module_seed(request) -> int:
  """`seed` for module-scoped fixtures: the hash of the module's id (`<file>`), moved by
  `DOS_JAX_TEST_SEED` alike; a failed test that uses it reports it too."""
  return _seed_of(request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """A failed test that took the `seed` fixture reports its seed and how to rerun it."""
  del call
  report = yield
  if report.failed:
    properties = list(item.user_properties)
    if 'module_seed' in getattr(item, 'fixturenames', ()):
      properties.append(('seed', _seed_of(item.nodeid.split('::')[0])))
    for name, value in properties:
      if name == 'seed':
        start = os.environ.get(_SEED_ENV, '0')
        report.sections.append((
            'seed', f'seed {value} (from the test id, {_SEED_ENV}={start}); rerun: '
            f"{_SEED_ENV}={start} python3 -m pytest -n 0 '{item.nodeid}'"))
  return report
