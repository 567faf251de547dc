"""Tests of what the native host AdamW's kernels share: the instruction-set probe and the
element loop's low-precision cast. The row-wise kernel itself: test_kernels_host_rows.py.

(The flat host kernel these tests were written for left the library; its own tests
went with it. The rows kernel runs the same loop, so the cast is checked through it.)
"""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import kernels
from dos_jax.kernels import host_adamw
from dos_jax.kernels import host_adamw_disk
from dos_jax.kernels import host_adamw_rows
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars

# The package builds the libraries on every x86-64 Linux install: missing there is a bug.
_MUST_HAVE = platform.system() == 'Linux' and platform.machine() in ('x86_64', 'AMD64')

pytestmark = pytest.mark.skipif(
    not _MUST_HAVE and not host_adamw_rows.rows_kernel_available(),
    reason=f'native host AdamW not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')


def test_available_on_x86_64_linux():
  """The native libraries setup.py builds on x86-64 Linux are there (the disk tier's
  test modules skip without theirs: here its absence fails)."""
  if _MUST_HAVE:
    probe, why = host_adamw._load()  # pylint: disable=protected-access
    assert probe is not None, why
    assert host_adamw_rows.rows_kernel_available(), host_adamw_rows.rows_kernel_unavailable_reason()
    assert host_adamw_disk.disk_kernel_available(), host_adamw_disk.disk_kernel_unavailable_reason()
  assert kernels.HostIsa.BASELINE in kernels.supported_isas()


@pytest.mark.parametrize('lowp_dtype', [jnp.bfloat16, jnp.float16])
def test_low_precision_cast_matches_xla_on_edge_values(lowp_dtype, seed):
  # With zero gradients and state, the update is 0 and lowp = master.astype(lowp):
  # rounding ties, f16 subnormals and overflow, NaN and inf, f32 subnormals (flushed).
  edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.9, 65520.0, 65536.0, 1e5, 6e-8, 3e-8,
                    2.98e-8, 6.1e-5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 3.4e38, 1e-40,
                    np.inf, -np.inf, np.nan, -np.nan], np.float32)
  rng = np.random.default_rng(seed)
  bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
  master = jnp.asarray(np.concatenate([edges, -edges, bits.view(np.float32)]))
  zeros = jnp.zeros_like(master)
  scalars = step_scalars(Hyper(weight_decay=0.0), 1)
  # One subgroup (a (1, 3, S) state: master, mu, nu), not decayed.
  new, out = kernels.adamw_host_rows(
      jnp.stack([master, zeros, zeros])[None], zeros[None], None, jnp.zeros(1, jnp.int32),
      scalars, slots=(0, 1, 2), decayed_rows=0, lowp_dtype=lowp_dtype)
  got = (new[0, 0], out[0])
  want = jax.jit(lambda *a: kernels.adamw_reference(
      *a, scalars, decay_limit=0, lowp_dtype=lowp_dtype))(master, zeros, zeros, zeros)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # NaN == NaN here
  # Bit for bit, except the sign and payload of NaNs, which IEEE leaves open.
  got_bits, want_bits = (np.asarray(x).view(np.uint16) for x in (got[1], want[3]))
  nan = np.isnan(np.asarray(want[3], np.float32))
  np.testing.assert_array_equal(np.isnan(np.asarray(got[1], np.float32)), nan)
  np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


def test_missing_probe_reports_no_instruction_set(monkeypatch):
  monkeypatch.setattr(host_adamw, '_load', lambda: (None, 'probe not built'))
  assert kernels.supported_isas() == ()
  with pytest.raises(ValueError, match='not supported by this CPU'):
    host_adamw.check_threads_and_isa(1, kernels.HostIsa.BASELINE)
