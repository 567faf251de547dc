"""The host AdamW's fresh out buffers: a large one (where the kernel asks for huge
pages) must hold the same values as a donated one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax.kernels import host_adamw_rows
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars

pytestmark = pytest.mark.skipif(not host_adamw_rows.rows_kernel_available(),
                                reason=host_adamw_rows.rows_kernel_unavailable_reason())


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_large_fresh_out_equals_donated_out(seed):
  """A fresh out buffer large enough for the huge-page hint holds the same values."""
  groups, size = 2, 1_100_000  # 8.8 MB of f32 out rows
  rng = np.random.default_rng(seed)
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
