"""The compute_on shim picks the right form on jax 0.10 and 0.11."""

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as compute_on_module

from dos_jax import memory_spaces


def _install(monkeypatch, module):
  """The installed jax's `compute_on` module reads as `module`'s (a stand-in)."""
  for name in ('compute_on', 'compute_on2'):
    if hasattr(module, name):
      monkeypatch.setattr(compute_on_module, name, getattr(module, name), raising=False)
    else:
      monkeypatch.delattr(compute_on_module, name, raising=False)


def _new_module(calls):
  """jax 0.11.2's module, signature from its source: the function form only."""

  def compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
    calls.append(('compute_on', compute_type, out_memory_spaces, compiler_options))
    return f

  return types.SimpleNamespace(compute_on=compute_on)


def _old_module(calls):
  """jax 0.10.2's module: a context manager whose one parameter is also called
  compute_type, and the function form as compute_on2."""
  import contextlib  # pylint: disable=import-outside-toplevel

  @contextlib.contextmanager
  def compute_on(compute_type: str):
    calls.append(('context', compute_type))
    yield

  def compute_on2(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
    calls.append(('compute_on2', compute_type, out_memory_spaces, compiler_options))
    return f

  return types.SimpleNamespace(compute_on=compute_on, compute_on2=compute_on2)


def test_jax_0_11_signature_gets_the_function_form_with_out_memory_spaces(monkeypatch):
  calls = []
  _install(monkeypatch, _new_module(calls))
  fn = memory_spaces.host_region(lambda x: x + 1)
  assert fn(1) == 2
  assert calls == [('compute_on', 'device_host', memory_spaces.HOST, None)]


def test_jax_0_10_signature_gets_compute_on2_not_the_context_manager(monkeypatch):
  calls = []
  _install(monkeypatch, _old_module(calls))
  fn = memory_spaces.host_region(lambda x: x * 3, out_spaces=(memory_spaces.HOST,))
  assert fn(2) == 6
  assert calls == [('compute_on2', 'device_host', (memory_spaces.HOST,), None)]


def test_context_manager_only_module_still_works(monkeypatch):
  calls = []
  module = _old_module(calls)
  del module.compute_on2
  _install(monkeypatch, module)
  fn = memory_spaces.host_region(lambda x: x - 1)
  assert fn(5) == 4
  assert calls == [('context', 'device_host')]


def test_installed_jax_host_region_runs_and_returns_host_memory():
  x = jax.device_put(jnp.arange(8.0), jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind='pinned_host'))

  @jax.jit
  def f(x):
    return memory_spaces.host_region(lambda y: y * 2 + 1)(x)

  out = f(x)
  np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 2 + 1)
  assert out.sharding.memory_kind == 'pinned_host'
  assert '_xla_compute_type = "host"' in f.lower(x).as_text()
