"""Tests of the native host AdamW against optax, the pure-jnp reference and itself."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import kernels
from tests.test_kernels_scalars import assert_close_to_optax
from tests.test_kernels_scalars import assert_trees_equal
from tests.test_kernels_scalars import check_across_decay_boundary
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import optax_trajectory
from tests.test_kernels_scalars import random_grad
from tests.test_kernels_scalars import random_state
from tests.test_kernels_scalars import step_scalars

# The package builds the library on every x86-64 Linux install: missing there is a bug.
_MUST_HAVE = platform.system() == 'Linux' and platform.machine() in ('x86_64', 'AMD64')

pytestmark = pytest.mark.skipif(
    not _MUST_HAVE and not kernels.host_kernel_available(),
    reason=f'native host AdamW not available: {kernels.host_kernel_unavailable_reason()}')

# Above 2 x 32768 elements the kernel really splits the work over two threads.
SIZES = (1, 7, 1000, 70_001)


def _host(hyper, count, state, grad, *, decay_limit, lowp_dtype=jnp.bfloat16,
          grad_scale=1.0, **kw):
  return kernels.adamw_host(*state, grad, step_scalars(hyper, count, grad_scale),
                            decay_limit=decay_limit, lowp_dtype=lowp_dtype,
                            nesterov=hyper.nesterov, **kw)


def _reference(hyper, count, state, grad, *, decay_limit, lowp_dtype=jnp.bfloat16,
               grad_scale=1.0):
  scalars = step_scalars(hyper, count, grad_scale)
  return jax.jit(lambda *a: kernels.adamw_reference(
      *a, scalars, decay_limit=decay_limit, lowp_dtype=lowp_dtype,
      nesterov=hyper.nesterov))(*state, grad)


def test_available_on_x86_64_linux():
  if _MUST_HAVE:
    assert kernels.host_kernel_available(), kernels.host_kernel_unavailable_reason()
  assert kernels.HostIsa.BASELINE in kernels.supported_isas()


@pytest.mark.parametrize('size', SIZES)
@pytest.mark.parametrize('decay', [True, False])
def test_fp32_matches_optax_bit_for_bit(size, decay):
  hyper = Hyper()
  rng = np.random.default_rng(size)
  master = random_state(rng, size)[0]
  grads = [random_grad(rng, size) for _ in range(3)]
  limit = size if decay else 0
  expected = optax_trajectory(hyper, master, grads, limit)
  state = (master, jnp.zeros(size), jnp.zeros(size))
  for count, (grad, want) in enumerate(zip(grads, expected), start=1):
    *state, lowp = _host(hyper, count, state, grad, decay_limit=limit, num_threads=2)
    assert_trees_equal(state, want)
    np.testing.assert_array_equal(np.asarray(lowp), want[0].astype(jnp.bfloat16))


@pytest.mark.parametrize('hyper', [
    Hyper(),
    Hyper(eps_root=1e-12, weight_decay=0.3, lr=3e-2),
    Hyper(nesterov=True),
], ids=['default', 'eps_root', 'nesterov'])
def test_matches_optax_across_a_decay_boundary(hyper):
  check_across_decay_boundary(_host, hyper, size=5003, limit=2001, seed=7, steps=4)


@pytest.mark.parametrize('size', SIZES)
@pytest.mark.parametrize('grad_dtype, mu_dtype, lowp_dtype', [
    (jnp.float32, jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, jnp.float16),
    (jnp.float32, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
])
def test_matches_jitted_reference(size, grad_dtype, mu_dtype, lowp_dtype):
  hyper = Hyper(nesterov=size == 1000, eps_root=1e-10)
  rng = np.random.default_rng(size + 1)
  state = random_state(rng, size, mu_dtype)
  grad = random_grad(rng, size, grad_dtype)
  limit = size // 3
  kw = dict(decay_limit=limit, lowp_dtype=lowp_dtype, grad_scale=np.float32(0.37))
  got = _host(hyper, 5, state, grad, **kw)
  want = _reference(hyper, 5, state, grad, **kw)
  for g, w in zip(got[:3], want[:3]):
    assert g.dtype == w.dtype and g.shape == w.shape
  assert_close_to_optax(got[:3], want[:3], hyper.lr)
  # lowp is exactly the cast of the new master, whatever the rounding of the rest.
  np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(got[0].astype(lowp_dtype)))


def test_bf16_gradients_and_grad_scale_match_optax_on_scaled_f32_grads():
  # The kernel's g = f32(grad) * grad_scale is exactly what optax sees when fed that.
  hyper, size, scale = Hyper(), 4099, np.float32(0.25)
  rng = np.random.default_rng(3)
  master = random_state(rng, size)[0]
  grads = [random_grad(rng, size, jnp.bfloat16) for _ in range(3)]
  expected = optax_trajectory(hyper, master, [g.astype(jnp.float32) * scale for g in grads],
                              size)
  state = (master, jnp.zeros(size), jnp.zeros(size))
  for count, (grad, want) in enumerate(zip(grads, expected), start=1):
    *state, _ = _host(hyper, count, state, grad, decay_limit=size, grad_scale=scale)
    assert_trees_equal(state, want)


def test_bf16_mu_tracks_float64_math():
  # optax's own bf16-mu path computes b1 * mu in bf16 (b1 rounded to 0.8984), so it is
  # no reference here; numpy float64 with bf16 storage rounding is.
  hyper, size = Hyper(), 3001
  rng = np.random.default_rng(4)
  master, mu, nu = random_state(rng, size, jnp.bfloat16)
  grad = random_grad(rng, size)
  scalars = step_scalars(hyper, 10)
  new_master, new_mu, new_nu, _ = kernels.adamw_host(
      master, mu, nu, grad, scalars, decay_limit=size, lowp_dtype=jnp.bfloat16)
  g, m, v, p = (np.asarray(x, np.float64) for x in (grad, mu, nu, master))
  m = 0.1 * g + 0.9 * m
  v = 0.001 * g * g + 0.999 * v
  u = (m / float(scalars.bc1)) / (np.sqrt(v / float(scalars.bc2)) + 1e-8) + 0.1 * p
  np.testing.assert_allclose(np.asarray(new_mu, np.float64), m, rtol=2**-8)
  np.testing.assert_allclose(np.asarray(new_nu), v, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(new_master), p - 1e-3 * u, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize('lowp_dtype', [jnp.bfloat16, jnp.float16])
def test_low_precision_cast_matches_xla_on_edge_values(lowp_dtype):
  # With zero gradients and state, the update is 0 and lowp = master.astype(lowp):
  # rounding ties, f16 subnormals and overflow, NaN and inf, f32 subnormals (flushed).
  edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.9, 65520.0, 65536.0, 1e5, 6e-8, 3e-8,
                    2.98e-8, 6.1e-5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 3.4e38, 1e-40,
                    np.inf, -np.inf, np.nan, -np.nan], np.float32)
  rng = np.random.default_rng(5)
  bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
  master = jnp.asarray(np.concatenate([edges, -edges, bits.view(np.float32)]))
  zeros = jnp.zeros_like(master)
  scalars = step_scalars(Hyper(weight_decay=0.0), 1)
  got = kernels.adamw_host(master, zeros, zeros, zeros, scalars, decay_limit=0,
                           lowp_dtype=lowp_dtype)
  want = jax.jit(lambda *a: kernels.adamw_reference(
      *a, scalars, decay_limit=0, lowp_dtype=lowp_dtype))(master, zeros, zeros, zeros)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # NaN == NaN here
  # Bit for bit, except the sign and payload of NaNs, which IEEE leaves open.
  got_bits, want_bits = (np.asarray(x[3]).view(np.uint16) for x in (got, want))
  nan = np.isnan(np.asarray(want[3], np.float32))
  np.testing.assert_array_equal(np.isnan(np.asarray(got[3], np.float32)), nan)
  np.testing.assert_array_equal(got_bits[~nan], want_bits[~nan])


@pytest.mark.parametrize('size', [70_001, 1_000_003])
def test_thread_counts_and_isas_agree_bit_for_bit(size):
  hyper = Hyper()
  rng = np.random.default_rng(6)
  state = random_state(rng, size)
  grad = random_grad(rng, size, jnp.bfloat16)
  first = _host(hyper, 2, state, grad, decay_limit=size // 2, num_threads=1)
  for isa in kernels.supported_isas():
    for threads in (1, 2, 3):
      got = _host(hyper, 2, state, grad, decay_limit=size // 2, num_threads=threads, isa=isa)
      assert_trees_equal(got, first)


def test_donated_call_updates_in_place_without_recompiling():
  size, hyper = 100_000, Hyper()
  rng = np.random.default_rng(8)
  state = random_state(rng, size)
  lowp = jnp.zeros(size, jnp.bfloat16)

  def step(state, lowp, grad, scalars):
    return kernels.adamw_host(*state, grad, scalars, decay_limit=size,
                              lowp_dtype=jnp.bfloat16, lowp_out=lowp)
  step = jax.jit(step, donate_argnums=(0, 1))

  hlo = step.lower(state, lowp, random_grad(rng, size), step_scalars(hyper, 1)).compile()
  assert 'output_to_operand_aliasing={{0}: (0, {}), {1}: (1, {}), {2}: (2, {}), ' \
         '{3}: (6, {})}' in hlo.as_text()
  pointers = None
  for count in range(1, 5):
    grad, scalars = random_grad(rng, size), step_scalars(hyper, count)
    # The scalars are traced here (as in a training step), so the reference gets them
    # traced too: then 1 - b1 is an f32 subtraction in both.
    want = jax.jit(lambda s, *a: kernels.adamw_reference(
        *a, s, decay_limit=size, lowp_dtype=jnp.bfloat16))(scalars, *state, grad)
    *state, lowp = step(tuple(state), lowp, grad, scalars)
    # From the second step on (the first may copy arrays that still view numpy memory)
    # every buffer is reused in place.
    now = [x.unsafe_buffer_pointer() for x in (*state, lowp)]
    assert pointers is None or now == pointers
    pointers = now
    assert_close_to_optax(state, want[:3], hyper.lr)
  assert step._cache_size() == 1  # traced scalars: one compile for every step


def test_undonated_call_leaves_its_inputs_alone():
  size = 1000
  rng = np.random.default_rng(9)
  state = random_state(rng, size)
  before = [np.asarray(x).copy() for x in state]
  got = _host(Hyper(), 1, state, random_grad(rng, size), decay_limit=size)
  assert_trees_equal(state, before)
  assert not np.array_equal(np.asarray(got[0]), before[0])


def test_vmap_over_stacked_subgroups_uses_per_subgroup_scalars():
  size, hyper = 4100, Hyper()
  rng = np.random.default_rng(10)
  rows = [random_state(rng, size) for _ in range(3)]
  grads = [random_grad(rng, size) for _ in range(3)]
  limits = jnp.asarray([0, 1234, size], jnp.int32)
  counts = [1, 5, 9]
  stacked = [jnp.stack(x) for x in zip(*rows)]
  scalars = jax.tree.map(lambda *x: jnp.stack([jnp.asarray(v, jnp.float32) for v in x]),
                         *[step_scalars(hyper, c) for c in counts])

  def one(master, mu, nu, grad, scalars, limit):
    return kernels.adamw_host(master, mu, nu, grad, scalars, decay_limit=limit,
                              lowp_dtype=jnp.bfloat16)
  got = jax.jit(jax.vmap(one))(*stacked, jnp.stack(grads), scalars, limits)
  for i in range(3):
    s = jax.tree.map(lambda x: x[i], scalars)
    want = kernels.adamw_host(*rows[i], grads[i], s, decay_limit=limits[i],
                              lowp_dtype=jnp.bfloat16)
    assert_trees_equal([x[i] for x in got], want)


def test_bad_thread_count_and_isa_are_clear_errors():
  x = jnp.zeros(8)
  with pytest.raises(ValueError, match='num_threads'):
    kernels.adamw_host(x, x, x, x, step_scalars(Hyper(), 1), decay_limit=8,
                       lowp_dtype=jnp.bfloat16, num_threads=0)
  with pytest.raises(ValueError, match='lowp_out'):
    kernels.adamw_host(x, x, x, x, step_scalars(Hyper(), 1), decay_limit=8,
                       lowp_dtype=jnp.bfloat16, lowp_out=jnp.zeros(8, jnp.float16))


def test_no_low_precision_copy_when_lowp_dtype_is_none():
  size, hyper = 70_001, Hyper()
  rng = np.random.default_rng(14)
  state, grad = random_state(rng, size), random_grad(rng, size)
  got = _host(hyper, 3, state, grad, decay_limit=size // 2, lowp_dtype=None)
  assert got[3] is None
  with_copy = _host(hyper, 3, state, grad, decay_limit=size // 2)
  assert_trees_equal(got[:3], with_copy[:3])


def test_missing_library_reports_why_and_raises(monkeypatch):
  from dos_jax.kernels import host_adamw  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_adamw, '_load', lambda: (None, 'native host AdamW not built'))
  assert not kernels.host_kernel_available()
  assert kernels.supported_isas() == ()
  with pytest.raises(RuntimeError, match='not built'):
    x = jnp.zeros(8)
    kernels.adamw_host(x, x, x, x, step_scalars(Hyper(), 1), decay_limit=8,
                       lowp_dtype=jnp.bfloat16)
