"""Loading a native host AdamW library and registering its XLA FFI targets.

The native modules (`_host_adamw_rows`, `_host_isa`) are optional: compiled when
the package is installed, possibly missing or unloadable. `load` says which, with the
reason, so that callers can fall back to XLA and report why.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import jax


def load(module: str, targets: Mapping[str, str], what: str) -> tuple[Any, str]:
  """Imports `dos_jax.kernels.<module>` and registers its handlers with XLA:CPU.

  Args:
    module: name of the extension module within `dos_jax.kernels`.
    targets: FFI target name -> name of the module's function returning its handler.
    what: the library as error messages name it.

  Returns:
    `(module, '')`, or `(None, why)` when it cannot be imported or registered.
  """
  try:
    native = importlib.import_module(f'dos_jax.kernels.{module}')
  except ImportError as e:
    return None, f'{what} not built or not loadable: {e}'
  try:
    for target, handler in targets.items():
      jax.ffi.register_ffi_target(target, getattr(native, handler)(), platform='cpu')
  except Exception as e:  # pylint: disable=broad-except
    return None, f'registering the {what} with XLA failed: {e}'
  return native, ''
