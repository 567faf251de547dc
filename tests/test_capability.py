"""`capability`: the one decision whether the native host or the Pallas AdamW can run a
step's rows, with the first condition that fails as its reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from dos_jax.step import paths
from dos_jax.geometry import slots as slots_lib
from dos_jax.capability import Capability
from dos_jax.capability import capability
from dos_jax.capability import Kernel
from dos_jax.capability import USABLE
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.kernels import host_adamw_rows
from dos_jax.implementation import Program

NATIVE, PALLAS = Kernel.NATIVE_HOST, Kernel.PALLAS
CPU, GPU = Program.ONE_MEMORY, Program.TWO_MEMORIES
ADAMW = AdamWHyperparams(learning_rate=1e-3)
needs_kernel = pytest.mark.skipif(
    not host_adamw_rows.rows_kernel_available(),
    reason=f'not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')


def _step(mu_dtype=None, out_dtype=jnp.bfloat16) -> paths.RowStep:
  """The row step of AdamW's state (an fp32 master, mu, nu) over rows of 8 elements."""
  row = jnp.zeros((8,), jnp.float32)
  state = (row, (optax.scale_by_adam(mu_dtype=mu_dtype).init(row),))
  return paths.RowStep(row_update=None, slots=slots_lib.build(state, row_ndim=1),
                       has_master=True, decayed_rows=0, state_dtype=jnp.float32,
                       out_dtype=out_dtype)


def _grads(*dtypes):
  return [jnp.zeros((3,), d) for d in dtypes]


@pytest.mark.parametrize('kernel', [NATIVE, PALLAS])
def test_a_transform_other_than_adamw_takes_xla(kernel):
  usable, reason = capability(kernel, None, _step(), GPU, _grads(jnp.float32))
  assert not usable and 'not dos_jax.adamw' in reason


def test_pallas_runs_the_two_memory_programs_adamw_rows_only():
  assert capability(PALLAS, ADAMW, _step(), GPU) == USABLE
  assert capability(PALLAS, ADAMW, _step(), CPU) == Capability(
      False, 'the CPU program updates every row with the native host call')
  usable, reason = capability(PALLAS, ADAMW, _step(mu_dtype=jnp.bfloat16), GPU)
  assert not usable and 'one float32 group' in reason


def test_nesterov_keeps_xla_on_the_host():
  nesterov = AdamWHyperparams(learning_rate=1e-3, nesterov=True)
  usable, reason = capability(NATIVE, nesterov, _step(), CPU, _grads(jnp.float32))
  assert not usable and 'Nesterov' in reason
  assert capability(PALLAS, nesterov, _step(), GPU) == USABLE


@needs_kernel
def test_the_native_kernel_takes_one_gradient_dtype_and_adamws_layout():
  assert capability(NATIVE, ADAMW, _step(), CPU, _grads(jnp.float32, jnp.float32)) == USABLE
  assert capability(NATIVE, ADAMW, _step(), CPU, _grads(jnp.bfloat16)) == USABLE
  for grads, named in ((_grads(jnp.float32, jnp.bfloat16), 'bfloat16, float32'),
                       (_grads(jnp.float16), 'float16'), ([], '')):
    usable, reason = capability(NATIVE, ADAMW, _step(), CPU, grads)
    assert not usable and reason.endswith(f'got {named}')
  usable, reason = capability(NATIVE, ADAMW, _step(mu_dtype=jnp.bfloat16), CPU,
                              _grads(jnp.float32))
  assert not usable and 'one float32 group' in reason
  usable, reason = capability(NATIVE, ADAMW, _step(out_dtype=jnp.int8), CPU,
                              _grads(jnp.float32))
  assert not usable and 'int8' in reason


@needs_kernel
def test_in_the_two_memory_program_the_plugin_decides(monkeypatch):
  """A GPU program's host regions need the kernel in the GPU plugin too: the verdict
  (and its one warning) is `host_kernel_in_two_memory_programs`'s."""
  verdict = capability(NATIVE, ADAMW, _step(), GPU, _grads(jnp.float32))
  assert isinstance(verdict, Capability)
  if jax.default_backend() == 'cpu':  # the CPU backend takes the kernel wherever it is built
    assert verdict == (True, '')
  # A plugin that refuses the kernel turns the verdict, with the plugin's reason.
  refusal = (False, 'the cuda plugin refused the handler (a stand-in reason)')
  monkeypatch.setattr(host_adamw_rows, 'host_kernel_in_two_memory_programs', lambda: refusal)
  assert capability(NATIVE, ADAMW, _step(), GPU, _grads(jnp.float32)) == refusal
  assert capability(NATIVE, ADAMW, _step(), CPU, _grads(jnp.float32)) == (True, '')
