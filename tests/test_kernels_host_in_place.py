"""The host AdamW's out leaves written over the gradient leaves, and fresh out buffers.

`adamw_host_leaves(..., into_grads=True)` returns the out values as one array per
gradient leaf, aliased to it by XLA; it must give exactly what the `(G, S)` out rows
give, on every instruction set and thread count, including leaves longer than the
kernel's in-place block and leaves that span subgroup rows. A large fresh out buffer
(where the kernel asks for huge pages) must hold the same values as a donated one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import kernels
from dos_jax.kernels import host_adamw_rows
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars

pytestmark = pytest.mark.skipif(not host_adamw_rows.rows_kernel_available(),
                                reason=host_adamw_rows.rows_kernel_unavailable_reason())

GROUPS, SIZE = 3, 6000
# Leaf 1 spans rows 0 and 1; leaf 0 is longer than the 2048-element in-place block.
SHAPES = ((10, 500), (7, 1001), (3,), (1200,))
OFFSETS = (12_100, 1_000, 8_500, 9_000)


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _case(master: bool, seed: int):
  rng = np.random.default_rng(seed)
  dtype = jnp.bfloat16 if master else jnp.float32
  k = 3 if master else 2
  stacked = rng.standard_normal((GROUPS, k, SIZE)).astype(np.float32)
  stacked[:, k - 1] = np.abs(stacked[:, k - 1]) * 1e-3  # nu >= 0
  grads = [jnp.asarray(rng.standard_normal(s) * 1e-2, dtype) for s in SHAPES]
  params = None if master else [jnp.asarray(rng.standard_normal(s), jnp.float32)
                                for s in SHAPES]
  slots = (0, 1, 2) if master else (-1, 0, 1)
  return jnp.asarray(stacked), grads, params, slots, dtype


@pytest.mark.parametrize('master', [True, False], ids=['master_bf16', 'no_master_f32'])
def test_into_grads_equals_out_rows_on_every_isa(master):
  stacked, grads, params, slots, dtype = _case(master, seed=5)
  rows = jnp.arange(GROUPS, dtype=jnp.int32)
  scalars = step_scalars(Hyper(), 3)
  common = dict(offsets=OFFSETS, slots=slots, decayed_rows=2, lowp_dtype=dtype)
  want_state, want_rows = host_adamw_rows.adamw_host_leaves(
      stacked, grads, params, rows, scalars, **common)
  flat = np.asarray(want_rows).reshape(-1)
  for isa in kernels.supported_isas():
    for threads in (1, 2):
      call = jax.jit(functools.partial(host_adamw_rows.adamw_host_leaves, rows=rows,
                                       scalars=scalars, into_grads=True, isa=isa,
                                       num_threads=threads, **common),
                     donate_argnums=(1,))
      state, outs = call(stacked, [g + 0 for g in grads], params)
      np.testing.assert_array_equal(_bits(state), _bits(want_state), err_msg=f'{isa}')
      for out, shape, offset, grad in zip(outs, SHAPES, OFFSETS, grads):
        assert out.shape == shape and out.dtype == dtype
        want = flat[offset:offset + int(np.prod(shape))]
        np.testing.assert_array_equal(_bits(out).ravel(), _bits(want),
                                      err_msg=f'{isa}, {threads} threads')
        assert not np.array_equal(_bits(out), _bits(grad))  # really written


def test_into_grads_aliases_gradients_made_in_the_program():
  """Gradients computed inside the program are overwritten: no out buffer is added."""
  stacked, grads, params, slots, dtype = _case(master=True, seed=6)
  rows = jnp.arange(GROUPS, dtype=jnp.int32)
  scalars = step_scalars(Hyper(), 2)

  def step(state, g, into):
    g = [x * 2 for x in g]  # temporaries of the program, as a backward pass makes
    return host_adamw_rows.adamw_host_leaves(
        state, g, None, rows, scalars, offsets=OFFSETS, slots=slots, decayed_rows=1,
        lowp_dtype=dtype, into_grads=into)

  temps = {}
  for into in (False, True):
    compiled = jax.jit(functools.partial(step, into=into), donate_argnums=(0,)).lower(
        stacked, grads).compile()
    memory = compiled.memory_analysis()
    temps[into] = memory.temp_size_in_bytes + memory.output_size_in_bytes
  grad_bytes = sum(int(np.prod(s)) * 2 for s in SHAPES)
  state_bytes = stacked.size * 4
  # The rows form holds the doubled gradients and the (G, S) out rows; in place, only
  # the doubled gradients, which become the out leaves (besides the state, aliased).
  assert temps[True] <= state_bytes + grad_bytes + (1 << 12), temps
  assert temps[False] >= temps[True] + GROUPS * SIZE * 2, temps


def test_into_grads_bad_inputs_are_clear_errors():
  stacked, grads, params, slots, _ = _case(master=True, seed=7)
  run = functools.partial(host_adamw_rows.adamw_host_leaves, stacked, grads, None,
                          scalars=step_scalars(Hyper(), 1), offsets=OFFSETS, slots=slots,
                          decayed_rows=1, into_grads=True)
  with pytest.raises(ValueError, match='lowp_dtype == the gradients'):
    run(rows=jnp.arange(GROUPS), lowp_dtype=jnp.float32)
  with pytest.raises(ValueError, match='every one of the 3 subgroups'):
    run(rows=jnp.arange(2), lowp_dtype=jnp.bfloat16)


def test_large_fresh_out_equals_donated_out():
  """A fresh out buffer large enough for the huge-page hint holds the same values."""
  groups, size = 2, 1_100_000  # 8.8 MB of f32 out rows
  rng = np.random.default_rng(8)
  stacked = rng.standard_normal((groups, 2, size)).astype(np.float32)
  stacked[:, 1] = np.abs(stacked[:, 1])
  grads = jnp.asarray(rng.standard_normal((groups, size)) * 1e-2, jnp.float32)
  params = jnp.asarray(rng.standard_normal((groups, size)), jnp.float32)
  call = functools.partial(host_adamw_rows.adamw_host_rows, grads=grads, params=params,
                           rows=jnp.arange(groups), scalars=step_scalars(Hyper(), 4),
                           slots=(-1, 0, 1), decayed_rows=1, lowp_dtype=jnp.float32)
  fresh_state, fresh = jax.jit(call)(jnp.asarray(stacked))
  donated_state, donated = jax.jit(lambda s, o: call(s, out=o), donate_argnums=(1,))(
      jnp.asarray(stacked), jnp.full((groups, size), 3.0, jnp.float32))
  np.testing.assert_array_equal(_bits(fresh), _bits(donated))
  np.testing.assert_array_equal(_bits(fresh_state), _bits(donated_state))
  assert np.isfinite(np.asarray(fresh)).all() and np.any(np.asarray(fresh) != 0)
