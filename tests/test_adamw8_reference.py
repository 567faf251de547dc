"""Tests of the 8-bit moments' reference (kernels/adamw8_reference.py): its code maps and
quantizer against bitsandbytes' (the `quant-ref` extra; skipped without it), the
quantizer against a brute-force nearest search, and its step against optax.adamw in
float64 within the quantization error bound."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax.kernels import adamw8_reference as ref

B = ref.BLOCK_SIZE


def _bitsandbytes():
  """(torch, bitsandbytes.functional), or a skip naming the extra."""
  torch = pytest.importorskip('torch', reason='the quant-ref extra (torch CPU) is not installed')
  try:
    import bitsandbytes.functional as bnb_f  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    pytest.skip(f'the quant-ref extra (bitsandbytes) is not installed: {e}')
  return torch, bnb_f


def random_moment(rng, shape, signed: bool) -> np.ndarray:
  """float32 values whose magnitude varies by up to 6 decades between blocks and 3
  within one, with a block of exact zeros: the ranges a moment's blocks take."""
  size = shape[-1]
  blocks = ref.num_blocks(size)
  scale = 10.0**rng.uniform(-6, 0, (*shape[:-1], blocks))
  x = rng.normal(size=shape) * 10.0**rng.uniform(-3, 0, shape)
  x = x * np.repeat(scale, B, axis=-1)[..., :size]
  if not signed:
    x = np.abs(x)
  x[..., :B] = 0 if size > 2 * B else x[..., :B]
  return x.astype(np.float32)


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Distance in fp32 steps between same-signed float32 arrays."""
  return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_maps_by_hand():
  # Values one can check from the construction (module doc): level 0's midpoint
  # 0.55e-6 (signed, one bin) and 0.325e-6, 0.775e-6 (unsigned, two bins); level 6's
  # top midpoints 1 - 0.45/64 (signed) and 1 - 0.45/128 (unsigned).
  s, u = ref.dynamic_map(signed=True), ref.dynamic_map(signed=False)
  assert (np.diff(s) > 0).all() and (np.diff(u) > 0).all()
  assert s[127] == 0 and s[255] == 1 and (s[:127] < 0).all()
  np.testing.assert_allclose(s[128], 0.55e-6, rtol=1e-15)
  np.testing.assert_allclose(s[254], 1 - 0.45 / 64, rtol=1e-15)
  np.testing.assert_allclose(-s[:127][::-1], s[128:255], rtol=0)  # negatives mirror
  assert u[0] == 0 and u[255] == 1
  np.testing.assert_allclose(u[1:3], [0.325e-6, 0.775e-6], rtol=1e-15)
  np.testing.assert_allclose(u[254], 1 - 0.45 / 128, rtol=1e-15)
  # Level i holds 2^i (signed, per sign) or 2^(i+1) (unsigned) values in [1e-7, 1e-6)*10^i.
  for i in range(ref.EXPONENT_LEVELS):
    lo, hi = 10.0**(i - 7), 10.0**(i - 6)
    assert ((s >= lo) & (s < hi)).sum() == 2**i
    assert ((u >= lo) & (u < hi)).sum() == 2**(i + 1)


def test_maps_match_bitsandbytes():
  # bitsandbytes builds the map in float32 arithmetic (torch.linspace, then the
  # midpoints and the decade factor each rounded); this reference in float64, rounded
  # once. Measured: at most 2 fp32 steps apart (72 signed, 100 unsigned entries differ).
  _, bnb_f = _bitsandbytes()
  for signed in (True, False):
    theirs = bnb_f.create_dynamic_map(signed=signed).numpy()
    ours = ref.code_map(signed)
    assert theirs.dtype == np.float32 and theirs.shape == (256,)
    assert (np.sign(theirs) == np.sign(ours)).all()
    assert _ulps(ours, theirs).max() <= 2


def test_quantize_is_the_nearest_code(seed):
  rng = np.random.default_rng(seed)
  for signed in (True, False):
    table = ref.code_map(signed)
    x = random_moment(rng, (3, 5 * B + 17), signed)
    q = ref.quantize(x, table)
    assert q.codes.dtype == np.uint8 and q.scales.dtype == np.float32
    assert q.codes.shape == x.shape and q.scales.shape == (3, 6)
    blocks = np.pad(x, [(0, 0), (0, 6 * B - x.shape[1])]).reshape(3, 6, B)
    np.testing.assert_array_equal(q.scales, np.abs(blocks).max(-1))  # bit for bit
    s = np.repeat(q.scales.astype(np.float64), B, axis=-1)[:, :x.shape[1]]
    xn = np.divide(x, s, out=np.zeros(x.shape), where=s > 0)
    # Brute force: the first index of the smallest distance (ties to the lower index).
    want = np.abs(xn[..., None] - table.astype(np.float64)).argmin(-1)
    np.testing.assert_array_equal(q.codes, want)
    zero = int(np.flatnonzero(table == 0)[0])
    assert (q.codes[:, :B] == zero).all() and (q.scales[:, 0] == 0).all()
    back = ref.dequantize(q, table)
    np.testing.assert_array_equal(back[:, :B], 0)
    # The round trip is off by at most half the gap between the entries around x/scale.
    bound, _ = _quantization_bound(q, table, x)
    assert (np.abs(back - x) <= bound).all()


def test_quantize_and_dequantize_match_bitsandbytes_cpu(seed):
  # bitsandbytes' CPU quantize_blockwise (csrc/cpu_ops.cpp) first rounds x / absmax to
  # a grid of 65536 steps over [-1, 1] and looks the nearest code up for that grid
  # point: its code is the nearest code of a value within one step w = 2 / 65535 of
  # x / absmax. So: where no midpoint between codes lies within w of x / absmax, the
  # codes are equal; elsewhere theirs is among the nearest codes of [x - w, x + w].
  # Both quantize with this reference's map (passed as `code`). Scales: bit for bit.
  # A block of zeros gets code 0 there, the code of 0 here: both decode to 0.
  # Dequantization (code value * absmax in fp32) bit for bit.
  torch, bnb_f = _bitsandbytes()
  rng = np.random.default_rng(seed)
  w = 2 / 65535
  for signed in (True, False):
    table = ref.code_map(signed)
    x = random_moment(rng, (8 * B + 100,), signed)
    q = ref.quantize(x, table)
    codes, state = bnb_f.quantize_blockwise(torch.from_numpy(x), code=torch.from_numpy(
        table.copy()), blocksize=B)
    np.testing.assert_array_equal(state.absmax.numpy(), q.scales)
    s = np.repeat(q.scales.astype(np.float64), B)[:x.size]
    xn = np.divide(x, s, out=np.zeros(x.shape), where=s > 0)
    lo, hi = ref.nearest_code(xn - w, table), ref.nearest_code(xn + w, table)
    theirs = np.where(s > 0, codes.numpy(), q.codes)  # the zero block (see above)
    assert ((theirs >= lo) & (theirs <= hi)).all()
    clear = lo == hi
    assert clear.mean() > 0.5  # most elements are checked for equality
    np.testing.assert_array_equal(theirs[clear], q.codes[clear])
    back = bnb_f.dequantize_blockwise(torch.from_numpy(q.codes.copy()), state, blocksize=B)
    np.testing.assert_array_equal(back.numpy(), ref.dequantize(q, table).astype(np.float32))


def _optax_step(params, mu, nu, grad, count, hyper, nesterov):
  """optax.adamw's step in float64 from (mu, nu) after `count - 1` steps."""
  with jax.enable_x64(True):
    opt = optax.adamw(hyper['lr'], b1=hyper['b1'], b2=hyper['b2'], eps=hyper['eps'],
                      eps_root=hyper['eps_root'], weight_decay=hyper['weight_decay'],
                      nesterov=nesterov)
    p = jnp.asarray(params, jnp.float64)
    state = opt.init(p)
    state = (state[0]._replace(count=jnp.int32(count - 1), mu=jnp.asarray(mu),
                               nu=jnp.asarray(nu)),) + tuple(state[1:])
    updates, state = opt.update(jnp.asarray(grad, jnp.float64), state, p)
    return (np.asarray(optax.apply_updates(p, updates)), np.asarray(state[0].mu),
            np.asarray(state[0].nu))


def _quantization_bound(q, table, exact):
  """(bound, scale) per element: half the gap between the map entries around
  exact / scale (below the signed map's lowest entry: the distance to it), times scale,
  with 2^-23 of the scale for the rounding of the scale and the entries."""
  size = exact.shape[-1]
  s = np.repeat(q.scales.astype(np.float64), B, axis=-1)[..., :size]
  xn = np.divide(exact, s, out=np.zeros(exact.shape), where=s > 0)
  t = table.astype(np.float64)
  k = np.clip(np.searchsorted(t, xn, side='right') - 1, 0, 254)
  half_gap = np.where(xn < t[0], t[0] - xn, (t[k + 1] - t[k]) / 2)  # below -0.993: to it
  return s * (half_gap + 2.0**-23), s


@pytest.mark.parametrize('nesterov', [False, True])
def test_step_matches_optax_float64_within_the_quantization_bound(nesterov, seed):
  # From the same decoded moments the reference's float64 step is optax's: the new
  # params agree to float64 rounding (rtol 1e-12: the reference multiplies by 1 / bc
  # where optax divides). The stored moments are optax's new moments quantized: each
  # within half the gap of the code map around it (times the block scale), which is at
  # most 0.0071 of the block's absolute maximum for mu (signed map, top gap 0.9 / 64)
  # and 0.0036 for nu (unsigned, 0.9 / 128).
  rng = np.random.default_rng(seed)
  hyper = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12, weight_decay=0.1)
  size = 4 * B + 33
  master = rng.normal(size=size)
  mu, nu = ref.zeros((size,))
  for count in range(1, 4):
    grad = random_moment(rng, (size,), signed=True)
    m0 = ref.dequantize(mu, ref.code_map(True))
    v0 = ref.dequantize(nu, ref.code_map(False))
    want_p, want_m, want_v = _optax_step(master, m0, v0, grad, count, hyper, nesterov)
    bc = lambda b, c: 1 - b**c
    master, mu, nu = ref.adamw8_step(
        master, mu, nu, grad, **hyper, bc1=bc(hyper['b1'], count),
        bc2=bc(hyper['b2'], count), bc1_next=bc(hyper['b1'], count + 1),
        decay_limit=size, nesterov=nesterov)
    np.testing.assert_allclose(master, want_p, rtol=1e-12, atol=0)
    for q, want, signed, worst in ((mu, want_m, True, 0.0071), (nu, want_v, False, 0.0036)):
      table = ref.code_map(signed)
      err = np.abs(ref.dequantize(q, table) - want)
      bound, scale = _quantization_bound(q, table, want)
      assert (err <= bound).all()
      assert (err <= worst * scale).all()
      master = want_p  # the next step starts from optax's params and the stored moments


def test_float32_step_is_the_float64_step_rounded(seed):
  # The fp32 form (the kernels' arithmetic) against the float64 form: params within
  # fp32 rounding of a few operations (rtol 1e-5 of the update), the same scales to
  # fp32 rounding of the moments (rtol 1e-6), codes within one of each other.
  rng = np.random.default_rng(seed)
  size = 3 * B + 5
  master = rng.normal(size=size).astype(np.float32)
  mu = ref.quantize(random_moment(rng, (size,), True), ref.code_map(True))
  nu = ref.quantize(random_moment(rng, (size,), False), ref.code_map(False))
  grad = random_moment(rng, (size,), True)
  kw = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1,
            bc1=1 - 0.9**5, bc2=1 - 0.999**5, decay_limit=size // 2)
  p32, m32, v32 = ref.adamw8_step(master, mu, nu, grad, dtype=np.float32, **kw)
  p64, m64, v64 = ref.adamw8_step(master, mu, nu, grad, **kw)
  assert p32.dtype == np.float32
  # Plus the fp32 master's own rounding (2^-24 of it, twice).
  err = np.abs(p32 - p64)
  assert (err <= 1e-4 * np.abs(p64 - master) + 2.0**-23 * np.abs(p64)).all()
  for a, b in ((m32, m64), (v32, v64)):
    np.testing.assert_allclose(a.scales, b.scales, rtol=1e-6)
    assert np.abs(a.codes.astype(int) - b.codes.astype(int)).max() <= 1


def test_docstring_example_runs():
  result = doctest.testmod(ref, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0, result
