"""Registering native FFI handlers inside a GPU PJRT plugin, for GPU programs' host regions.

A GPU program's host regions (`compute_on('device_host')`) are compiled and run by the
GPU PJRT plugin (`jax_plugins/xla_cuda13/xla_cuda_plugin.so` and the like): a separate
XLA build with its own FFI registry. `jax.ffi.register_ffi_target(..., platform='cpu')`
(what `_native.load` does) reaches jaxlib's XLA only, so without more the plugin fails
such a program with "No registered implementation for custom call to ... for platform
Host". The plugin's PJRT FFI extension registers a handler for a platform by name; the
native library's `register_with_pjrt` (pjrt_register.cc) walks the plugin's `PJRT_Api`
to that extension and registers our handlers there for "Host".

Finding the plugin's `PJRT_Api*` needs what JAX keeps private, so every route is
guarded and a failure is a reason to report, never an exception: the caller falls back
to XLA's host loop.

A registration that "succeeds" proves nothing: the plugin's `PJRT_FFI_Register_Handler`
ignores its registry's answer, so a handler of an FFI API version the plugin does not
accept (a library built against newer headers) or a second handler under a taken name
is dropped while the call reports success; and a host region calling a handler the
plugin lacks is not a Python error but an abort inside its compiler. `probe_in_plugin`
therefore compiles, in a child process (`dos_jax.dataflow.kernel_probe`), a tiny GPU
program whose host region calls every target, with the plugin's compile-only client (no
GPU needed, as `dos_jax.dataflow.compile` does); the child registers the same handlers
of the same library in the same plugin library first, so its verdict is this process's.
The verdict is cached on disk (`dos_jax.cache.cache_dir('kernel_probe')`), keyed by the
plugin library (path, size, mtime), the native library's sha256, the targets and the
jax / jaxlib versions: a few seconds once per installation, a file read afterwards.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

import jax

from dos_jax import cache

# Platforms served by a GPU PJRT plugin whose host regions run on the host.
GPU_PLATFORMS = ('cuda', 'rocm')
# XLA's name for the platform of host computations inside a GPU program.
HOST_PLATFORM = 'Host'


def gpu_platforms() -> list[str]:
  """The GPU platforms with devices in this process (starts JAX's backends)."""
  found = []
  for platform in GPU_PLATFORMS:
    try:
      if jax.devices(platform):
        found.append(platform)
    except Exception:  # pylint: disable=broad-except  # unknown or failed backend
      continue
  return found


def _api_from_jax(platform: str) -> tuple[Any, str]:
  """The capsule JAX registered the plugin with (`jax_internals.backend_c_api`)."""
  from dos_jax.kernels import jax_internals  # pylint: disable=import-outside-toplevel
  return jax_internals.backend_c_api(platform)


def _api_from_library(platform: str) -> tuple[Any, str]:
  """`GetPjrtApi()` of the plugin library, if JAX has already loaded it.

  The plugin packages (`jax_plugins.xla_cuda13`, `xla_cuda12`, ...) say where their
  library is (`_get_library_path`); opening it with RTLD_NOLOAD gives the copy already
  in the process (the one JAX's backend uses) and never loads a second one.
  """
  reasons = []
  for name in sorted(list(sys.modules)):
    module = sys.modules.get(name)
    if not name.startswith('jax_plugins.') or platform not in name or module is None:
      continue
    get_path = getattr(module, '_get_library_path', None)
    if not callable(get_path):
      continue
    try:
      path = get_path()
      if not path:
        continue
      library = ctypes.CDLL(os.fspath(path),
                            mode=getattr(os, 'RTLD_NOLOAD', 0) | os.RTLD_LOCAL)
      get_api = library.GetPjrtApi
      get_api.restype = ctypes.c_void_p
      get_api.argtypes = []
      address = get_api()
    except Exception as e:  # pylint: disable=broad-except
      reasons.append(f'{name}: {e}')
      continue
    if address:
      return int(address), ''
    reasons.append(f'{name}: GetPjrtApi() returned null')
  return None, '; '.join(reasons) or f'no loaded jax_plugins module for {platform!r}'


def plugin_c_api(platform: str) -> tuple[Any, str]:
  """The `PJRT_Api*` of the plugin serving `platform`: a capsule or an int address.

  Returns `(api, '')`, or `(None, why)` when no route finds it.
  """
  api, why_jax = _api_from_jax(platform)
  if api is not None:
    return api, ''
  api, why_library = _api_from_library(platform)
  if api is not None:
    return api, ''
  return None, f'no PJRT_Api for {platform!r} ({why_jax}; {why_library})'


def register(native: Any, targets: Mapping[str, str], platform: str,
             api: Any) -> str:
  """Registers the handlers of `native` in the plugin `api` for XLA platform "Host".

  Args:
    native: the loaded extension module (has `register_with_pjrt`).
    targets: FFI target name -> name of the module's function returning its handler.
    platform: the JAX platform the plugin serves (only for messages).
    api: the plugin's `PJRT_Api*`, a capsule or an int address.

  Returns:
    '' on success, else why not.
  """
  register_with_pjrt = getattr(native, 'register_with_pjrt', None)
  if register_with_pjrt is None:
    return 'the native library predates register_with_pjrt: rebuild it (pip install -e .)'
  try:
    pairs = [(name, getattr(native, handler)()) for name, handler in targets.items()]
    why = register_with_pjrt(api, HOST_PLATFORM, pairs)
  except Exception as e:  # pylint: disable=broad-except
    why = f'{type(e).__name__}: {e}'
  return f'{platform} plugin: {why}' if why else ''


# --- proving the registration: a probe compile in a child process ----------------------

# Seconds a probe compile may take (about 2-5 s on the 2-core CI machine; the first run
# of a process reads the 400 MB plugin library from disk).
PROBE_TIMEOUT_S = 300
# Bump when what the probe checks changes: older cached verdicts are then ignored.
_PROBE_VERSION = 1
# The child's verdict, one line on stdout after this marker.
_VERDICT_MARKER = 'dos_jax probe verdict: '
# The plugin packages, newest first (`jax[cuda13]`, `jax[cuda12]`).
_CUDA_PLUGIN_MODULES = ('jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12')


def plugin_library(platform: str = 'cuda') -> str | None:
  """Path of the PJRT plugin library serving `platform`, or None if none is installed.

  Asks the plugin package (`_get_library_path`), already imported by JAX's plugin
  discovery or imported here (a small Python module: the library is not loaded).
  """
  if platform != 'cuda':
    return None
  names = [n for n in sorted(sys.modules) if n.startswith('jax_plugins.xla_cuda')]
  names += [n for n in _CUDA_PLUGIN_MODULES if n not in names]
  for name in names:
    module = sys.modules.get(name)
    if module is None:
      try:
        if importlib.util.find_spec(name) is None:
          continue
        module = importlib.import_module(name)
      except Exception:  # pylint: disable=broad-except  # no such plugin, or a broken one
        continue
    get_path = getattr(module, '_get_library_path', None)
    try:
      path = get_path() if callable(get_path) else None
    except Exception:  # pylint: disable=broad-except
      path = None
    if path and os.path.isfile(path):
      return os.fspath(path)
  return None


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def _jaxlib_version() -> str:
  from dos_jax.kernels import jax_internals  # pylint: disable=import-outside-toplevel
  return jax_internals.jaxlib_version()


def probe_key(native: Any, targets: Mapping[str, str], plugin_path: str) -> dict[str, Any]:
  """What a probe's verdict depends on: the plugin library and the native library."""
  stat = os.stat(plugin_path)
  return {'probe': _PROBE_VERSION, 'plugin': [os.path.realpath(plugin_path), stat.st_size,
                                              stat.st_mtime_ns],
          'native': _sha256(native.__file__), 'targets': sorted(targets.items()),
          'jax': jax.__version__, 'jaxlib': _jaxlib_version()}


def probe_cache_path(key: Mapping[str, Any]) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
  return os.fspath(cache.cache_dir('kernel_probe', f'{digest}.json'))


def _read_verdict(path: str, key: Mapping[str, Any]) -> tuple[bool, str] | None:
  try:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or record.get('key') != json.loads(json.dumps(key)):
    return None
  return bool(record.get('ok')), str(record.get('why', ''))


def _write_verdict(path: str, key: Mapping[str, Any], ok: bool, why: str,
                   seconds: float) -> None:
  """Atomically (a concurrent probe writes the same verdict); failures are ignored."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.tmp')
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      json.dump({'key': key, 'ok': ok, 'why': why, 'probe_s': round(seconds, 2),
                 'when': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, f, indent=1)
    os.chmod(tmp, cache.umask_mode())
    os.replace(tmp, path)
  except OSError:
    pass


def verdict_line(ok: bool, why: str) -> str:
  """The line by which the child reports its verdict on stdout (read by `run_probe`)."""
  return _VERDICT_MARKER + json.dumps({'ok': ok, 'why': why})


def _probe_command(spec: Mapping[str, Any]) -> list[str]:
  """The child's command line: `dos_jax.dataflow.kernel_probe`, a
  program of its own, run where the compile-only client lives. A command line, not an
  import: nothing of the dataflow layer is loaded in this process."""
  return [sys.executable, '-c',
          'import sys; from dos_jax.dataflow import kernel_probe; kernel_probe.main(sys.argv[1])',
          json.dumps(spec)]


def _probe_env() -> dict[str, str]:
  """The child's environment: the plugin's compile-only client (JAX_PLATFORMS=cpu, which
  works with or without a GPU) and this process's dos_jax first on the path."""
  env = dict(os.environ)
  env['JAX_PLATFORMS'] = 'cpu'
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(cache.__file__)))
  env['PYTHONPATH'] = os.pathsep.join(
      [package_root] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  return env


def _death_reason(returncode: int, stderr: str) -> str:
  """Why the child died, from its exit status and the most telling line it wrote."""
  if returncode < 0:
    try:
      status = f'killed by {signal.Signals(-returncode).name}'
    except ValueError:
      status = f'killed by signal {-returncode}'
  else:
    status = f'exit status {returncode}'
  lines = [line.strip() for line in stderr.splitlines() if line.strip()]
  telling = [line for line in lines if 'Check failed' in line or 'NOT_FOUND' in line]
  detail = (telling or lines or ['(no output)'])[-1]
  what = 'died' if returncode else 'gave no verdict'
  return f'the probe compile {what} ({status}): {detail[:400]}'


def run_probe(native: Any, targets: Mapping[str, str],
              timeout_s: float | None = None) -> tuple[bool, str, bool]:
  """Compiles a host region calling every target in a child process.

  Returns `(ok, why, definitive)`: `definitive` is False when the child could not say
  (it timed out or could not start), which is not worth caching.
  """
  timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
  spec = {'module': native.__name__, 'targets': dict(targets)}
  try:
    done = subprocess.run(_probe_command(spec), env=_probe_env(), capture_output=True,
                          text=True, timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired:
    return False, f'the probe compile did not finish within {timeout_s:.0f} s', False
  except OSError as e:
    return False, f'the probe compile could not start: {e}', False
  for line in reversed(done.stdout.splitlines()):
    if line.startswith(_VERDICT_MARKER):
      try:
        verdict = json.loads(line[len(_VERDICT_MARKER):])
        return bool(verdict['ok']), str(verdict.get('why', '')), True
      except (ValueError, KeyError, TypeError):
        break
  return False, _death_reason(done.returncode, done.stderr), True


def probe_in_plugin(native: Any, targets: Mapping[str, str],
                    platform: str = 'cuda') -> tuple[bool, str]:
  """Whether the CUDA plugin really compiles host regions calling `targets`.

  The verdict is cached (see the module docstring); a probe that could not decide
  (timeout) is not. Returns `(True, '')` or `(False, why)`; never raises, never aborts.
  """
  path = plugin_library(platform)
  if path is None:
    return False, f'no {platform} PJRT plugin library found to probe the registration with'
  try:
    key = probe_key(native, targets, path)
  except OSError as e:
    return False, f'cannot identify the libraries to probe: {e}'
  cached = probe_cache_path(key)
  verdict = _read_verdict(cached, key)
  if verdict is not None:
    return verdict
  start = time.perf_counter()
  ok, why, definitive = run_probe(native, targets)
  if definitive:
    _write_verdict(cached, key, ok, why, time.perf_counter() - start)
  return ok, why
