"""Whether a native library's FFI targets may be called inside GPU programs' host regions.

A GPU program's host regions are compiled and run by the GPU PJRT plugin's own XLA,
whose FFI registry `jax.ffi.register_ffi_target` does not reach, so a library's
handlers are registered there for XLA platform "Host" (`_pjrt.register`), and a probe
compile proves the plugin took them (`_pjrt.probe_in_plugin`: the plugin's registration
reports success even when it drops a handler, and a missing handler aborts its
compiler). `PluginKernel` holds one library's verdict for the process: for its live
CUDA backend (looked at once), or, with no GPU, for compiling GPU programs without one
(`register_for_gpu_compile`). Each native library (`host_adamw_rows`, the in-memory
host tiers; `host_adamw_disk`, the disk tier) has one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

from dos_jax.kernels import _pjrt

NO_CUDA_BACKEND = ('no CUDA backend in this process and no compile-only registration '
                   '(dos_jax.dataflow.compile.prepare): no GPU program is built here')


class PluginKernel:
  """One native library's standing inside GPU plugins, decided once per process.

  Args:
    load: returns `(module, '')` or `(None, why)` (the library's `_load`).
    targets: FFI target name -> name of the module's function returning its handler.
    warning: format of the one warning a process logs when its GPU programs cannot
      call the library (`%s`: why, then the library's FFI API major and minor), or
      None where the caller refuses instead of falling back.
  """

  def __init__(self, load: Callable[[], tuple[Any, str]], targets: Mapping[str, str],
               warning: str | None = None):
    self.load = load
    self.targets = dict(targets)
    self.warning = warning
    self.lock = threading.RLock()
    # Live GPU backends: None until looked at, () when there are none (JAX's backends
    # are fixed once started), else the verdict.
    self.live: tuple[bool, str] | tuple[()] | None = None
    # `register_for_gpu_compile`'s verdict, once called.
    self.compile_only: tuple[bool, str] | None = None
    self.warned = False

  def _warn_once(self, why: str) -> None:
    if self.warned or self.warning is None:
      return
    self.warned = True
    version = getattr(self.load()[0], 'ffi_api_version', lambda: ('?', '?'))()
    logging.getLogger(__name__).warning(self.warning, why, *version)

  def _register_and_probe(self, native: Any, platform: str, api: Any) -> tuple[bool, str]:
    """Registers the targets in the plugin `api`, then proves that it took them."""
    why = _pjrt.register(native, self.targets, platform, api)
    if why:
      return False, why
    if platform != 'cuda':
      return False, (f'{platform} plugin: registered, but only a CUDA plugin can be probed, '
                     'and an unproven registration may abort the compile')
    ok, why = _pjrt.probe_in_plugin(native, self.targets, platform)
    return (True, '') if ok else (False, f'{platform} plugin did not take the handlers: {why}')

  def in_gpu_programs(self) -> tuple[bool, str]:
    """Whether host regions of GPU programs may call the library: `(ok, why not)`.

    True only when registration and probe held, for the process's live CUDA backend
    (done here, once) or after `register_for_gpu_compile`. `(False, NO_CUDA_BACKEND)`
    when neither exists (nothing is warned: no GPU program is built).
    """
    native, why = self.load()
    if native is None:
      return False, why
    with self.lock:
      if self.live is None:
        self.live = ()
        platforms = _pjrt.gpu_platforms()
        if platforms:
          verdict = True, ''
          for platform in platforms:
            api, why = _pjrt.plugin_c_api(platform)
            verdict = (self._register_and_probe(native, platform, api) if api is not None
                       else (False, why))
            if not verdict[0]:
              break
          self.live = verdict
          if not verdict[0]:
            self._warn_once(verdict[1])
      if self.live:
        return self.live
      if self.compile_only is not None:
        return self.compile_only
    return False, NO_CUDA_BACKEND

  def in_two_memory_programs(self) -> tuple[bool, str]:
    """Whether a two-memory program traced now may call the library: for a CUDA
    plugin `in_gpu_programs()`; otherwise the program runs on the CPU backend, whose
    host regions run in jaxlib's XLA (registered by `_native.load`): yes whenever the
    library loads."""
    ok, why = self.in_gpu_programs()
    if ok or why != NO_CUDA_BACKEND:
      return ok, why
    return True, ''

  def register_for_gpu_compile(self) -> tuple[bool, str]:
    """Registers the handlers in the CUDA plugin for compiling GPU programs without a
    GPU (its compile-only topology must exist) and proves it took them: `(True, '')`
    or `(False, why)`. Done once per process."""
    native, why = self.load()
    if native is None:
      return False, why
    with self.lock:
      if self.compile_only is None:
        api, why = _pjrt.plugin_c_api('cuda')
        verdict = (self._register_and_probe(native, 'cuda', api) if api is not None
                   else (False, why))
        self.compile_only = verdict
        if not verdict[0]:
          self._warn_once(verdict[1])
      return self.compile_only
