"""Tests of the native 8-bit-moment host AdamW (kernels/host_adamw8.cc) against the numpy
reference's fp32 step (kernels/adamw8_reference.py, dtype=np.float32), which the
reference's own tests hold to optax in float64 and to bitsandbytes' quantizer.

Masters, the 16-bit copy and the scales: bit for bit. Codes: equal, except where the
new moment over its block's scale lies within 4 fp32 steps of a midpoint between two map
entries (the kernel multiplies by the fp32 reciprocal of the scale, the reference
divides in float64): there they may differ by one.
"""

from __future__ import annotations

import doctest

import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax.kernels import adamw8_reference as ref
from dos_jax.kernels import host_adamw8
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import HostIsa
from dos_jax.kernels.host_adamw import supported_isas
from tests.test_adamw8_reference import random_moment

pytestmark = pytest.mark.skipif(not host_adamw8.adamw8_kernel_available(),
                                reason=host_adamw8.adamw8_kernel_unavailable_reason())

B = ref.BLOCK_SIZE
HYPER = dict(lr=3e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12, weight_decay=0.1)


def _scalars(count: int, grad_scale: float, nesterov: bool) -> tuple[AdamWScalars, dict]:
  """The kernel's AdamWScalars and the reference's keywords, the same numbers."""
  bc = dict(bc1=1 - HYPER['b1']**count, bc2=1 - HYPER['b2']**count,
            bc1_next=1 - HYPER['b1']**(count + 1))
  scalars = AdamWScalars(**HYPER, bc1=bc['bc1'], bc2=bc['bc2'], grad_scale=grad_scale,
                         bc1_next=bc['bc1_next'] if nesterov else None)
  return scalars, dict(HYPER, **bc, grad_scale=grad_scale, nesterov=nesterov)


def _near_a_midpoint(x: np.ndarray, q: ref.Quantized, signed: bool, ulps: int = 4) -> np.ndarray:
  """Elements whose x / scale is within `ulps` fp32 steps of a midpoint of the map."""
  t = ref.code_map(signed).astype(np.float64)
  mids = (t[:-1] + t[1:]) / 2
  s = np.repeat(q.scales.astype(np.float64), B, axis=-1)[..., :x.shape[-1]]
  xn = np.divide(x.astype(np.float64), s, out=np.zeros(x.shape), where=s > 0)
  k = np.clip(np.searchsorted(mids, xn), 1, 254)
  dist = np.minimum(np.abs(xn - mids[k - 1]), np.abs(xn - mids[k]))
  return dist <= ulps * 2.0**-24 * np.maximum(np.abs(xn), 2.0**-24)


def assert_codes_match(got, want: ref.Quantized, exact: np.ndarray, signed: bool,
                       ulps: int = 4) -> None:
  """Codes equal, or one apart where exact / scale is within `ulps` of a midpoint."""
  codes = np.asarray(got.codes).astype(np.int64)
  differ = codes != want.codes
  assert (np.abs(codes - want.codes)[differ] == 1).all()
  assert _near_a_midpoint(exact, want, signed, ulps)[differ].all(), (
      f'{differ.sum()} codes differ away from a midpoint')


def _run(rng, shape, grad_dtype, lowp_dtype, nesterov, decayed_rows, steps, isa,
         grad_scale=1.0):
  master = rng.normal(size=shape).astype(np.float32)
  mu, nu = ref.zeros(shape)
  if steps > 1:  # start from moments with history, not only zeros
    mu = ref.quantize(random_moment(rng, shape, True), ref.code_map(True))
    nu = ref.quantize(random_moment(rng, shape, False), ref.code_map(False))
  k_master, k_mu, k_nu = jnp.asarray(master), ref.Quantized(*map(jnp.asarray, mu)), \
      ref.Quantized(*map(jnp.asarray, nu))
  for count in range(1, steps + 1):
    grad = random_moment(rng, shape, True)
    grad_in = jnp.asarray(grad, grad_dtype)
    grad = np.asarray(grad_in.astype(jnp.float32))  # what the kernel reads
    scalars, kw = _scalars(count, grad_scale, nesterov)
    k_master, k_mu, k_nu, out = host_adamw8.adamw8_host(
        k_master, k_mu, k_nu, grad_in, scalars, decayed_rows=decayed_rows,
        lowp_dtype=lowp_dtype, nesterov=nesterov, isa=isa)
    limit = shape[-1] if decayed_rows > 0 else 0
    rows = [ref.adamw8_step(master[r], ref.Quantized(mu.codes[r], mu.scales[r]),
                            ref.Quantized(nu.codes[r], nu.scales[r]), grad[r], **kw,
                            decay_limit=limit if r < decayed_rows else 0,
                            dtype=np.float32, with_moments=True)
            for r in range(shape[0])]
    master = np.stack([r[0] for r in rows])
    m = np.stack([r[3] for r in rows])
    v = np.stack([r[4] for r in rows])
    want_mu = ref.Quantized(np.stack([r[1].codes for r in rows]),
                            np.stack([r[1].scales for r in rows]))
    want_nu = ref.Quantized(np.stack([r[2].codes for r in rows]),
                            np.stack([r[2].scales for r in rows]))
    np.testing.assert_array_equal(np.asarray(k_master), master)
    np.testing.assert_array_equal(np.asarray(k_mu.scales), want_mu.scales)
    np.testing.assert_array_equal(np.asarray(k_nu.scales), want_nu.scales)
    assert_codes_match(k_mu, want_mu, m, True)
    assert_codes_match(k_nu, want_nu, v, False)
    if lowp_dtype is None:
      assert out is None
    else:
      np.testing.assert_array_equal(np.asarray(out), np.asarray(
          jnp.asarray(master).astype(lowp_dtype)))
    # The next step starts from the kernel's codes (they may differ by one at a tie).
    mu = ref.Quantized(np.asarray(k_mu.codes), np.asarray(k_mu.scales))
    nu = ref.Quantized(np.asarray(k_nu.codes), np.asarray(k_nu.scales))


@pytest.mark.parametrize('grad_dtype, lowp_dtype, nesterov', [
    (jnp.bfloat16, jnp.bfloat16, False),
    (jnp.float32, jnp.float32, True),
    (jnp.float32, None, False),
    (jnp.bfloat16, jnp.float16, False),
])
def test_matches_the_float32_reference(grad_dtype, lowp_dtype, nesterov, seed):
  rng = np.random.default_rng(seed)
  # Ragged rows (S not a multiple of 256), one decayed row of three, 3 steps.
  _run(rng, (3, 5 * B + 77), grad_dtype, lowp_dtype, nesterov, decayed_rows=1, steps=3,
       isa=HostIsa.AUTO, grad_scale=0.5)


@pytest.mark.parametrize('isa', supported_isas(), ids=lambda i: i.name)
def test_every_instruction_set_gives_the_same_result(isa, seed):
  _run(np.random.default_rng(seed), (2, 3 * B + 1), jnp.bfloat16, jnp.bfloat16, False,
       decayed_rows=2, steps=2, isa=isa)


def test_one_flat_row_of_many_blocks(seed):
  # A 1-D row: the wrapper's (S,) form, split over the threads by blocks.
  rng = np.random.default_rng(seed)
  size = 300 * B + 3
  master = rng.normal(size=size).astype(np.float32)
  mu, nu = ref.zeros((size,))
  grad = random_moment(rng, (size,), True)
  scalars, kw = _scalars(1, 1.0, False)
  got = host_adamw8.adamw8_host(jnp.asarray(master), ref.Quantized(*map(jnp.asarray, mu)),
                                ref.Quantized(*map(jnp.asarray, nu)), jnp.asarray(grad),
                                scalars, decayed_rows=1, lowp_dtype=jnp.bfloat16,
                                num_threads=2)
  want = ref.adamw8_step(master, mu, nu, grad, **kw, decay_limit=size, dtype=np.float32,
                         with_moments=True)
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_array_equal(np.asarray(got[1].scales), want[1].scales)
  assert_codes_match(got[1], want[1], want[3], True)
  assert_codes_match(got[2], want[2], want[4], False)


def test_encoding_tables_give_the_nearest_code(seed):
  # The tables the kernels encode with (host_adamw8.encode, their numpy form) against
  # the reference's nearest code: on random values over 9 decades, on every midpoint
  # between entries and its fp32 neighbours, on the entries, and on 0, -0, +-1, 1.5, inf.
  rng = np.random.default_rng(seed)
  for signed in (True, False):
    table = ref.code_map(signed).astype(np.float64)
    mids = ((table[:-1] + table[1:]) / 2).astype(np.float32)
    around = [mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2))]
    x = np.concatenate([
        rng.uniform(-1, 1, 50_000), 10**rng.uniform(-9, 0.01, 50_000) * rng.choice([-1, 1], 50_000),
        *around, *[-a for a in around], table, -table,
        [0.0, -0.0, 1.0, -1.0, 1.5, np.inf, -np.inf]]).astype(np.float32)
    want = ref.nearest_code(x.astype(np.float64), ref.code_map(signed))
    np.testing.assert_array_equal(host_adamw8.encode(x, signed), want)


def test_bad_shapes_name_the_argument():
  mu, nu = ref.zeros((2, 300))
  scalars, _ = _scalars(1, 1.0, False)
  bad = ref.Quantized(jnp.asarray(mu.codes), jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match=r'mu\.scales must be f32 \[2, 2\]'):
    host_adamw8.adamw8_host(jnp.ones((2, 300)), bad, nu, jnp.ones((2, 300)), scalars,
                            decayed_rows=0)


def test_docstring_example_runs():
  result = doctest.testmod(host_adamw8, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0, result
