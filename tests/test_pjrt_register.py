"""Registering the native host AdamW inside a GPU PJRT plugin (kernels/pjrt_register.cc):
everything around the C walker, which tests/test_pjrt_walker.py tests on its own.

On CPU: the Python routes to a plugin (with the walker's fake `PJRT_Api`) and the no-CUDA
case; the probe that proves a registration (with a stand-in child) and its cache; the
FFI API version the library was built with. With the CUDA plugin (`compiled_gpu` marker,
compile-only client): the probe passes for the real handlers and rejects a handler of a
too-new FFI API version, which falls back with one warning instead of aborting. On a GPU
(`gpu` marker): the native kernel called in a host region of a GPU program compiles, runs
and agrees with the same call on the CPU backend; that is the only proof that the
handlers reach the plugin's registry.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax.kernels import _pjrt
from dos_jax.kernels import host_adamw_rows
from dos_jax.kernels import plugin_kernel
from tests.test_kernels_host_rows import random_stacked
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars
from tests.test_pjrt_walker import FakePlugin
from tests.test_pjrt_walker import capsule

pytestmark = pytest.mark.skipif(
    not host_adamw_rows.rows_kernel_available(),
    reason=f'not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')


def _native():
  return host_adamw_rows._load()[0]  # pylint: disable=protected-access


def _handlers():
  return host_adamw_rows._HANDLERS  # pylint: disable=protected-access


# --- the Python routes ------------------------------------------------------------------

@pytest.fixture
def fresh(monkeypatch, tmp_path):
  """A process that has not yet looked at GPU plugins, with its own probe cache."""
  monkeypatch.setattr(host_adamw_rows, '_PLUGIN', plugin_kernel.PluginKernel(  # pylint: disable=protected-access
      host_adamw_rows._load, _handlers(), host_adamw_rows._WARNING))  # pylint: disable=protected-access
  monkeypatch.setenv('DOS_JAX_CACHE_DIR', str(tmp_path / 'cache'))
  return tmp_path


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _no_probe(*args, **kwargs):
  raise AssertionError('no probe expected')


@pytest.mark.usefixtures('fresh')
def test_no_cuda_devices_reports_false(monkeypatch, caplog):
  """No CUDA backend and no compile-only registration: nothing is registered or probed,
  the kernel is not usable in GPU programs, and nothing is warned; two-memory programs
  then run on the CPU backend, whose host regions have the kernel."""
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: [])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', _no_probe)
  monkeypatch.setattr(_pjrt, 'probe_in_plugin', _no_probe)
  with caplog.at_level(logging.WARNING):
    ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
    assert (ok, why) == (False, host_adamw_rows.NO_CUDA_BACKEND)
    assert why.startswith('no CUDA backend')
    assert host_adamw_rows.host_kernel_in_two_memory_programs() == (True, '')
  assert not _warnings(caplog)


@pytest.mark.usefixtures('fresh')
def test_no_cuda_devices_on_this_machine_reports_false():
  if _pjrt.gpu_platforms():
    pytest.skip('this machine has a GPU backend')
  assert host_adamw_rows.host_kernel_in_gpu_programs() == (
      False, host_adamw_rows.NO_CUDA_BACKEND)


@pytest.mark.usefixtures('fresh')
def test_found_plugin_gets_the_handlers_and_the_probe_decides(monkeypatch):
  plugin = FakePlugin()
  probed = []
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: ['cuda'])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', lambda p: (capsule(plugin.address), ''))
  monkeypatch.setattr(_pjrt, 'probe_in_plugin',
                      lambda native, targets, platform: probed.append(dict(targets)) or (True, ''))
  for _ in range(2):
    assert host_adamw_rows.host_kernel_in_gpu_programs() == (True, '')
    assert host_adamw_rows.host_kernel_in_two_memory_programs() == (True, '')
  assert [c[0] for c in plugin.calls] == list(_handlers())  # registered once
  assert probed == [_handlers()]  # after registering, once


@pytest.mark.usefixtures('fresh')
def test_registered_but_not_taken_falls_back_once(monkeypatch, caplog):
  """The plugin reports success, the probe shows it dropped the handlers."""
  plugin = FakePlugin()
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: ['cuda'])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', lambda p: (capsule(plugin.address), ''))
  monkeypatch.setattr(_pjrt, 'probe_in_plugin',
                      lambda *a: (False, 'the probe compile died (killed by SIGABRT): NOT_FOUND'))
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
      assert not ok and 'did not take the handlers' in why and 'NOT_FOUND' in why
      assert host_adamw_rows.host_kernel_in_two_memory_programs() == (False, why)
    assert not host_adamw_rows.register_for_gpu_compile()[0]
  lines = _warnings(caplog)
  assert len(lines) == 1 and "XLA's host loop" in lines[0] and why in lines[0]
  assert 'XLA FFI API %d.%d' % _native().ffi_api_version() in lines[0]


@pytest.mark.usefixtures('fresh')
def test_failure_is_reported_once(monkeypatch, caplog):
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: ['cuda'])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', lambda p: (None, 'no PJRT_Api for cuda'))
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
  assert not ok and why == 'no PJRT_Api for cuda'
  lines = _warnings(caplog)
  assert len(lines) == 1 and "XLA's host loop" in lines[0] and why in lines[0]


@pytest.mark.usefixtures('fresh')
def test_compile_only_registration_is_what_gpu_programs_get(monkeypatch):
  plugin = FakePlugin()
  verdicts = iter([(True, '')])
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: [])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', lambda p: (plugin.address, ''))
  monkeypatch.setattr(_pjrt, 'probe_in_plugin', lambda *a: next(verdicts))
  assert host_adamw_rows.host_kernel_in_gpu_programs()[1] == host_adamw_rows.NO_CUDA_BACKEND
  assert host_adamw_rows.register_for_gpu_compile() == (True, '')
  assert host_adamw_rows.register_for_gpu_compile() == (True, '')  # once per process
  assert host_adamw_rows.host_kernel_in_gpu_programs() == (True, '')
  assert host_adamw_rows.host_kernel_in_two_memory_programs() == (True, '')


@pytest.mark.usefixtures('fresh')
def test_rocm_registration_cannot_be_proven(monkeypatch, caplog):
  plugin = FakePlugin()
  monkeypatch.setattr(_pjrt, 'gpu_platforms', lambda: ['rocm'])
  monkeypatch.setattr(_pjrt, 'plugin_c_api', lambda p: (plugin.address, ''))
  monkeypatch.setattr(_pjrt, 'probe_in_plugin', _no_probe)
  with caplog.at_level(logging.WARNING):
    ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
  assert not ok and 'rocm' in why and len(_warnings(caplog)) == 1


# --- the probe: its child, its verdicts, its cache (a stand-in child; no plugin needed) ---

_ABORT = (
    'import os, sys\n'
    'sys.stderr.write("W warming up\\nF1124 gpu_compiler.cc:2983] Check failed: '
    'cpu_compilation_result is OK (NOT_FOUND: No FFI handler registered for t on a '
    'platform Host (canonical host)\\n*** Check failure stack trace: ***\\n")\n'
    'sys.stderr.flush()\n'
    'os.abort()\n')


@pytest.fixture
def stand_in(fresh, monkeypatch):  # pylint: disable=redefined-outer-name
  """A fake plugin library file and a stand-in probe child running `stand_in.code`."""
  library = fresh / 'xla_cuda_plugin.so'
  library.write_bytes(b'a plugin')
  child = types.SimpleNamespace(code='', runs=0, library=library)

  def command(spec):
    child.runs += 1
    assert spec == {'module': _native().__name__, 'targets': _handlers()}
    return [sys.executable, '-c', child.code]

  monkeypatch.setattr(_pjrt, 'plugin_library', lambda platform='cuda': str(library))
  monkeypatch.setattr(_pjrt, '_probe_command', command)
  return child


def _verdict_line(ok: bool, why: str = '') -> str:
  return f'print({_pjrt._VERDICT_MARKER!r} + {json.dumps({"ok": ok, "why": why})!r})'  # pylint: disable=protected-access


def _probe():
  return _pjrt.probe_in_plugin(_native(), _handlers())


def test_probe_pass_is_cached(stand_in):  # pylint: disable=redefined-outer-name
  stand_in.code = _verdict_line(True)
  assert _probe() == (True, '')
  key = _pjrt.probe_key(_native(), _handlers(), str(stand_in.library))
  with open(_pjrt.probe_cache_path(key), encoding='utf-8') as f:
    record = json.load(f)
  assert record['ok'] and record['key']['native'] == _pjrt._sha256(_native().__file__)  # pylint: disable=protected-access
  stand_in.code = 'raise SystemExit("not run again")'
  assert _probe() == (True, '') and stand_in.runs == 1
  # Another plugin library (here: the same file changed) is probed again.
  stand_in.library.write_bytes(b'another plugin')
  stand_in.code = _verdict_line(False, 'registering t for Host failed: duplicate')
  assert _probe() == (False, 'registering t for Host failed: duplicate')
  assert stand_in.runs == 2


def test_probe_abort_is_a_verdict_not_an_abort(stand_in):  # pylint: disable=redefined-outer-name
  stand_in.code = _ABORT
  ok, why = _probe()
  assert not ok and 'SIGABRT' in why
  assert 'Check failed' in why and 'No FFI handler registered for t' in why
  stand_in.code = _verdict_line(True)
  assert _probe() == (False, why) and stand_in.runs == 1  # cached


def test_undecided_probe_is_not_cached(stand_in, monkeypatch):  # pylint: disable=redefined-outer-name
  """A child that never answers (it waits on a pipe nobody writes) is cut off at the
  timeout, and its non-verdict is not cached: the next probe, under the module's own
  timeout, runs the child again."""
  default_timeout = _pjrt.PROBE_TIMEOUT_S
  monkeypatch.setattr(_pjrt, 'PROBE_TIMEOUT_S', 0.5)
  stand_in.code = 'import os; r, w = os.pipe(); os.read(r, 1)'  # blocks forever
  ok, why = _probe()
  assert not ok and 'did not finish' in why and stand_in.runs == 1
  monkeypatch.setattr(_pjrt, 'PROBE_TIMEOUT_S', default_timeout)
  stand_in.code = _verdict_line(True)
  assert _probe() == (True, '') and stand_in.runs == 2


@pytest.mark.usefixtures('fresh')
def test_probe_without_a_plugin_library(monkeypatch):
  monkeypatch.setattr(_pjrt, 'plugin_library', lambda platform='cuda': None)
  monkeypatch.setattr(_pjrt, '_probe_command', _no_probe)
  ok, why = _probe()
  assert not ok and 'no cuda PJRT plugin library' in why


# --- the FFI API version the library was built with ----------------------------------

def _header_api_version() -> tuple[int, int]:
  with open(os.path.join(jax.ffi.include_dir(), 'xla', 'ffi', 'api', 'c_api.h'),
            encoding='utf-8') as f:
    text = f.read()
  return tuple(int(re.search(rf'#define XLA_FFI_API_{p}\s+(\d+)', text).group(1))
               for p in ('MAJOR', 'MINOR'))


def test_library_api_version_is_one_the_running_jaxlib_accepts():
  """Built against the oldest supported headers (pyproject) or the environment's own."""
  major, minor = _native().ffi_api_version()
  assert (major, 1) <= (major, minor) <= _header_api_version()


def test_the_test_handler_reports_a_too_new_api_version():
  """What the plugin drops in silence, jaxlib's own registry refuses with a message:
  registered for the CPU (in a child: it breaks the CPU backend's start)."""
  code = ('import jax\n'
          'from dos_jax.kernels import _host_adamw_rows as n\n'
          'jax.ffi.register_ffi_target("t", n._test_handler_api_0_99(), platform="cpu")\n'
          'jax.numpy.ones(1).block_until_ready()\n')
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(
                 os.path.abspath(_pjrt.cache.__file__))), os.environ.get('PYTHONPATH', '')]))
  done = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode != 0
  assert "handler's API version (0.99) is incompatible" in done.stderr, done.stderr[-2000:]


# --- the probe against the real CUDA plugin (compile-only client, no GPU needed) ------

def _needs_gpu_compiler():
  from dos_jax import dataflow  # pylint: disable=g-import-not-at-top
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}')
  if jax.default_backend() != 'cpu':
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu')
  return dataflow


@pytest.mark.compiled_gpu
def test_plugin_probe_passes_for_the_real_handlers(fresh, caplog):  # pylint: disable=redefined-outer-name
  _needs_gpu_compiler()
  with caplog.at_level(logging.WARNING):
    assert host_adamw_rows.register_for_gpu_compile() == (True, '')
    assert host_adamw_rows.host_kernel_in_gpu_programs() == (True, '')
  assert not _warnings(caplog)
  assert len(list((fresh / 'cache' / 'kernel_probe').glob('*.json'))) == 1


@pytest.mark.compiled_gpu
def test_too_new_api_version_falls_back_with_one_warning(fresh, monkeypatch, caplog):  # pylint: disable=redefined-outer-name
  """A handler of FFI API 0.99: the plugin's registration "succeeds", the probe's compile
  aborts (in its child), and the step falls back to XLA's host loop, which compiles."""
  dataflow = _needs_gpu_compiler()
  import dos_jax  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_adamw_rows, '_PLUGIN', plugin_kernel.PluginKernel(  # pylint: disable=protected-access
      host_adamw_rows._load, {'dos_jax_test_api_0_99': '_test_handler_api_0_99'},  # pylint: disable=protected-access
      host_adamw_rows._WARNING))  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    assert not dataflow.compile.prepare()
    ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
    assert not ok and 'SIGABRT' in why
    assert 'No FFI handler registered for dos_jax_test_api_0_99' in why
    assert host_adamw_rows.host_kernel_in_two_memory_programs() == (False, why)
    params = {'w': jnp.ones((64, 32), jnp.float32)}
    offload = dos_jax.Offload(subgroup_size=1024, policy=dos_jax.AllHost())
    opt = dos_jax.adamw(1e-3, offload=offload, implementation=dos_jax.Implementation(program='gpu'))

    def step(p, s, g):
      u, s = opt.update(g, s, p)
      return jax.tree.map(jnp.add, p, u), s

    program = dataflow.compile_for_gpu(step, params, opt.init(params), params)
  assert 'dos_jax_adamw_host' not in program.hlo_text  # XLA's host loop
  assert program.schedule.host_calls
  lines = _warnings(caplog)
  assert len(lines) == 1 and why in lines[0] and "XLA's host loop" in lines[0]


def test_jax_route_reads_the_backend_registration(monkeypatch):
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  fake = types.SimpleNamespace(c_api='the capsule')
  monkeypatch.setitem(xla_bridge._backend_factories, 'cuda', fake)  # pylint: disable=protected-access
  assert _pjrt.plugin_c_api('cuda') == ('the capsule', '')


def test_library_route_never_loads_a_library(monkeypatch, tmp_path):
  """Only a plugin library already in the process is used (RTLD_NOLOAD)."""
  copy = tmp_path / 'xla_cuda_plugin.so'  # a loadable library, not loaded yet
  for name in [n for n in sys.modules if n.startswith('jax_plugins.')]:
    monkeypatch.delitem(sys.modules, name)  # a real plugin, loaded by an earlier test
  shutil.copyfile(_native().__file__, copy)
  missing = types.ModuleType('jax_plugins.xla_cuda99')
  missing._get_library_path = lambda: copy  # pylint: disable=protected-access
  monkeypatch.setitem(sys.modules, 'jax_plugins.xla_cuda99', missing)
  api, why = _pjrt._api_from_library('cuda')  # pylint: disable=protected-access
  assert api is None and 'xla_cuda99' in why
  if os.path.exists('/proc/self/maps'):
    with open('/proc/self/maps', encoding='utf-8') as maps:
      assert str(copy) not in maps.read()
  # A loaded library without GetPjrtApi: a reason, not an exception.
  loaded = types.ModuleType('jax_plugins.xla_cuda99')
  loaded._get_library_path = lambda: _native().__file__  # pylint: disable=protected-access
  monkeypatch.setitem(sys.modules, 'jax_plugins.xla_cuda99', loaded)
  api, why = _pjrt._api_from_library('cuda')  # pylint: disable=protected-access
  assert api is None and 'GetPjrtApi' in why


# --- on a GPU: the kernel in a host region of a GPU program ----------------------------

def _compute_on():
  """jax 0.11's `compute_on(f, *, compute_type, out_memory_spaces)`, or 0.10's
  `compute_on2` (same signature; 0.10's `compute_on` is a context manager)."""
  from jax.experimental import compute_on as module  # pylint: disable=g-import-not-at-top
  for name in ('compute_on', 'compute_on2'):
    fn = getattr(module, name, None)
    if fn is not None and 'out_memory_spaces' in inspect.signature(fn).parameters:
      return fn
  pytest.fail('no function form of compute_on in this jax')


@pytest.mark.gpu
@pytest.mark.parametrize('form', ['rows', 'rows_out_in', 'leaves'])
def test_native_kernel_runs_in_a_gpu_host_region(form, seed):
  ok, why = host_adamw_rows.host_kernel_in_gpu_programs()
  assert ok, why
  gpu, cpu = jax.devices()[0], jax.devices('cpu')[0]
  assert gpu.platform == 'gpu'
  pinned = jax.sharding.SingleDeviceSharding(gpu, memory_kind='pinned_host')
  rng = np.random.default_rng(seed)
  groups, size, slots, decayed_rows = 5, 1031, (0, 2, 1), 2
  rows = np.array([4, 0, 2], np.int32)
  stacked = random_stacked(rng, groups, size, slots)
  grads = (rng.standard_normal((groups, size)) * 1e-2).astype(jnp.bfloat16)
  out = np.full((groups, size), 7, jnp.bfloat16)
  # Plain numpy scalars: constants of the host region, not device arrays.
  scalars = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x,
                         step_scalars(Hyper(), 3))
  kw = dict(slots=slots, decayed_rows=decayed_rows, lowp_dtype=jnp.bfloat16)

  def update(st, g, r, o):
    if form == 'rows':
      return host_adamw_rows.adamw_host_rows(st, g[r], None, r, scalars, **kw)
    if form == 'rows_out_in':
      return host_adamw_rows.adamw_host_rows(st, g, None, r, scalars, out=o, indexed=True,
                                             **kw)
    return host_adamw_rows.adamw_host_leaves(st, [g[:2], g[2:]], None, r, scalars,
                                             offsets=[0, 2 * size], out=o, **kw)

  region = _compute_on()(update, compute_type='device_host',
                         out_memory_spaces=jax.memory.Space.Host)
  args = (stacked, grads, rows, out)
  got = jax.jit(region)(*jax.device_put(args, pinned))
  got = jax.block_until_ready(got)
  assert all(x.sharding.memory_kind == 'pinned_host' for x in got)
  want = jax.jit(update)(*jax.device_put(args, cpu))
  # The same native loop on the same host: equal up to how each XLA folds the scalars.
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=0)
  np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                             rtol=1e-2, atol=0)
  untouched = [g for g in range(groups) if g not in rows]
  np.testing.assert_array_equal(np.asarray(got[0])[untouched], stacked[untouched])
  assert not np.array_equal(np.asarray(got[0])[rows], stacked[rows])
