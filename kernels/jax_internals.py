"""Every private JAX or XLA detail dos_jax relies on, in one place.

Each name below stands in for a public API JAX does not have (yet); where one appears,
the name moves to it here and nowhere else. `problems()` lists what the installed jax
lacks, one line each naming the detail and what uses it; `tests/test_jax_internals.py`
fails with those lines when a new jax moves one.

| detail | used by | public API it stands in for |
|---|---|---|
| `core`, `mlir`, `pe`, `ir`, `func_dialect`, `hlo` | `step.device_stream` (a custom primitive lowered to an annotated call) | none: `compute_on('gpu_stream:N')` makes a stream region but no scheduling group, no tuple result |
| `STREAM_ANNOTATION`, `SCHEDULING_GROUP` | `step.device_stream`, `dataflow.schedule` | `compute_on('gpu_stream:N')` sets the first; the second has none |
| `host_call_name` (XLA's naming of host calls) | `dataflow.early_windows` | none |
| `backend_c_api` (`xla_bridge._backend_factories`) | `kernels._pjrt` (the plugin's FFI registry) | `jax.ffi.register_ffi_target` registers for the CPU client, not the CUDA plugin's host platform |
| `jaxlib_version` (`jax._src.lib.version_str`) | `kernels._pjrt` (build stamps) | `jaxlib.__version__` where importable |
| `abstract_device_type` (`jax._src.mesh.AbstractDevice`) | `dataflow.gpu_target` (Pallas lowering without a GPU) | none |
| `compile_options` (`jax._src.compiler.get_compile_options`), `device_list` | `dataflow.compile` (deviceless compiles) | `jax.jit(...).lower().compile()` on a topology's devices, which drops memory kinds |
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import jax

from jax._src import core  # pylint: disable=unused-import
from jax._src.interpreters import mlir  # pylint: disable=unused-import
from jax._src.interpreters import partial_eval as pe  # pylint: disable=unused-import
from jax._src.lib.mlir import ir  # pylint: disable=unused-import
from jax._src.lib.mlir.dialects import func as func_dialect  # pylint: disable=unused-import
from jax._src.lib.mlir.dialects import hlo  # pylint: disable=unused-import

# XLA's frontend attributes on a call: run it on GPU stream N; schedule it with the
# other instructions of group G in one go (latency-hiding scheduler).
STREAM_ANNOTATION = '_xla_stream_annotation'
SCHEDULING_GROUP = '_scheduling_group_id'

# jax 0.10 lowers a called computation from a ClosedJaxpr, 0.11 and later from a Jaxpr.
CALLED_TAKES_CLOSED = 'Closed' in str(
    inspect.signature(mlir.lower_called_computation).parameters['call_jaxpr'].annotation)


def host_call_name(n: int) -> str:
  """The start of XLA:GPU's host call number `n` in a compiled program (its host-call
  wrapper names K calls `host-call.K` .. `host-call.2K-1`, the last call first)."""
  return f'host-call.{n}.cloned.1.call-start'


def backend_c_api(platform: str) -> tuple[Any, str]:
  """`(the PJRT C API capsule JAX registered `platform`'s plugin with, '')`, or
  `(None, why not)`."""
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, f'jax._src.xla_bridge: {e}'
  factories = getattr(xla_bridge, '_backend_factories', None)
  registration = factories.get(platform) if hasattr(factories, 'get') else None
  c_api = getattr(registration, 'c_api', None)
  if c_api is None:
    return None, f'JAX holds no PJRT C API for {platform!r}'
  return c_api, ''


def jaxlib_version() -> str:
  """The installed jaxlib's version string, '?' where it cannot be read."""
  try:
    from jax._src.lib import version_str  # pylint: disable=import-outside-toplevel
    return str(version_str)
  except Exception:  # pylint: disable=broad-except
    return '?'


def abstract_device_type() -> Any:
  """`AbstractDevice` (names a GPU for lowering without one), or None."""
  try:
    from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
    return mesh_lib.AbstractDevice
  except (ImportError, AttributeError):
    return None


def compile_options(**kwargs) -> Any:
  """`jax._src.compiler.get_compile_options(**kwargs)`."""
  from jax._src import compiler  # pylint: disable=import-outside-toplevel
  return compiler.get_compile_options(**kwargs)


def device_list(devices) -> Any:
  """An XLA `DeviceList` of `devices` (a compile's executable devices)."""
  client = getattr(getattr(jax._src, 'lib', None), 'xla_client', None)  # pylint: disable=protected-access
  if hasattr(client, 'DeviceList'):
    return client.DeviceList(devices)
  from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
  return _jax.DeviceList(devices)


_EXPECTED = (
    ('jax._src.core', ('Primitive', 'jaxpr_as_fun'), 'step.device_stream'),
    ('jax._src.interpreters.mlir', ('lower_called_computation', 'register_lowering',
                                    'ir_tree_registry'), 'step.device_stream'),
    ('jax._src.interpreters.partial_eval', ('convert_constvars_jaxpr',), 'step.device_stream'),
    ('jax._src.xla_bridge', ('_backend_factories',), 'kernels._pjrt'),
    ('jax._src.lib', ('version_str',), 'kernels._pjrt'),
    ('jax._src.compiler', ('get_compile_options',), 'dataflow.compile'),
)


def problems() -> list[str]:
  """What the installed jax lacks of the details above: one line each, naming the
  detail, the jax version and the module of dos_jax that uses it."""
  found = []
  for module_name, names, user in _EXPECTED:
    try:
      module = importlib.import_module(module_name)
    except ImportError as e:
      found.append(f'jax {jax.__version__}: {module_name} is gone ({e}); used by {user}')
      continue
    for name in names:
      if not hasattr(module, name):
        found.append(f'jax {jax.__version__}: {module_name}.{name} is gone; used by {user}')
  if abstract_device_type() is None and jax.__version_info__[:2] >= (0, 11):
    found.append(f'jax {jax.__version__}: jax._src.mesh.AbstractDevice is gone; used by '
                 'dataflow.gpu_target')
  return found
