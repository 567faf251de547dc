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
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Mapping

import jax

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
  """The capsule JAX registered the plugin with (`xla_bridge._backend_factories`)."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, f'jax._src.xla_bridge: {e}'
  factories = getattr(xla_bridge, '_backend_factories', None)
  registration = factories.get(platform) if isinstance(factories, Mapping) else None
  c_api = getattr(registration, 'c_api', None)
  if c_api is None:
    return None, f'JAX holds no PJRT C API for {platform!r}'
  return c_api, ''


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


def register_in_gpu_plugins(native: Any, targets: Mapping[str, str]) -> tuple[bool, str]:
  """Registers the handlers in every GPU plugin of the process, for "Host".

  Returns:
    `(True, '')` when done or when there is no GPU backend (nothing to do: host
    regions then run in jaxlib's XLA, where `_native.load` registered them), else
    `(False, why)`.
  """
  for platform in gpu_platforms():
    api, why = plugin_c_api(platform)
    if api is None:
      return False, why
    why = register(native, targets, platform, api)
    if why:
      return False, why
  return True, ''
