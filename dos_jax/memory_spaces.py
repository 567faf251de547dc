"""The two memories of a step and the host-compute region: `HOST` and `DEVICE`, copies
between them (`put`, `to_host`; `copy_to` outside jit) and `host_region`, a computation
XLA runs on the host (`compute_on('device_host')`), on jax 0.10 and 0.11+ alike.

Example:
  >>> import jax, jax.numpy as jnp
  >>> x = jax.device_put(jnp.arange(3.0), jax.sharding.SingleDeviceSharding(
  ...     jax.devices()[0], memory_kind='pinned_host'))
  >>> jax.jit(host_region(lambda y: y * 2))(x).sharding.memory_kind
  'pinned_host'
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
from jax.experimental import compute_on as _compute_on_mod

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def compute_on_function() -> Callable[..., Any] | None:
  """The function form of `compute_on` in the installed jax, or None if it has only the
  old one.

  jax 0.11: `compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options)`.
  jax 0.10: `compute_on(compute_type)` is a context manager, and the function form is
  `compute_on2` with 0.11's signature. Both old and new name a parameter
  `compute_type`, so the forms are told apart by `out_memory_spaces`, which only the
  function form has (and which has no default there).
  """
  for name in ('compute_on', 'compute_on2'):
    candidate = getattr(_compute_on_mod, name, None)
    if candidate is None:
      continue
    try:
      parameters = inspect.signature(candidate).parameters
    except (TypeError, ValueError):
      continue
    if 'out_memory_spaces' in parameters:
      return candidate
  return None


def host_region(fn: Callable[..., Any], out_spaces: Any = None) -> Callable[..., Any]:
  """`fn` as a host-compute region (`compute_on('device_host')`) on every backend.

  Args:
    fn: the computation; its array inputs must already be in host memory.
    out_spaces: memory space of each output (a pytree prefix of the outputs, e.g. one
      `HOST` for all); default: host memory.
  """
  out_spaces = HOST if out_spaces is None else out_spaces
  form = compute_on_function()
  if form is not None:
    return form(fn, compute_type='device_host', out_memory_spaces=out_spaces)

  @functools.wraps(fn)
  def wrapped(*args):
    with _compute_on_mod.compute_on('device_host'):
      return fn(*args)

  return wrapped


def put(tree: Any, space) -> Any:
  """Copies every array of `tree` to a memory space (inside jit: an async copy)."""
  return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def to_host(tree: Any) -> Any:
  """Copies every array of `tree` to host memory (inside jit: an async D2H copy)."""
  return put(tree, HOST)


def copy_to(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """`x` (a concrete array) copied to `sharding`, its memory kind included.

  On the CPU backend by a jitted `device_put`: jax 0.12.1's CPU runtime refuses the direct
  copy of a buffer that a jitted program wrote to host memory ("Unsupported layout used
  for PjRt CPU buffers").

  Example:
    >>> x = jax.jit(lambda a: a * 2, out_shardings=jax.sharding.SingleDeviceSharding(
    ...     jax.devices()[0], memory_kind='pinned_host'))(jax.numpy.arange(3.0))
    >>> copy_to(x, x.sharding.with_memory_kind('device')).sharding.memory_kind
    'device'
  """
  if jax.default_backend() != 'cpu':
    return jax.device_put(x, sharding)
  return _jitted_copy_to(sharding)(x)


@functools.cache
def _jitted_copy_to(sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
  # The copy by memory space inside: a jitted identity keeps the input's memory space
  # in the result's type on jax 0.12.1.
  space = DEVICE if sharding.memory_kind in (None, 'device') else HOST
  return jax.jit(lambda x: jax.device_put(x, space), out_shardings=sharding)
