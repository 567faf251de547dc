"""Tests of the AdamW scalars contract, and helpers the kernel tests share.

The helpers run `jax.jit(optax.adamw)` itself on a flat vector cut in two leaves at the
weight-decay boundary (as the core packs decayed leaves first), which is the reference
every kernel is held to.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax import kernels
from dos_jax.kernels import adamw_scalars


@dataclasses.dataclass(frozen=True)
class Hyper:
  """optax.adamw hyperparameters, as Python floats (as optax normally gets them)."""

  lr: float = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  weight_decay: float = 0.1
  nesterov: bool = False


def step_scalars(hyper: Hyper, count: int, grad_scale=1.0) -> kernels.AdamWScalars:
  """Scalars of step `count` (1-based), bias corrections computed as optax does."""
  bias = jax.jit(lambda c: (1 - hyper.b1**c, 1 - hyper.b2**c, 1 - hyper.b1**(c + 1)))
  bc1, bc2, bc1_next = bias(jnp.int32(count))
  return kernels.AdamWScalars(
      lr=hyper.lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root,
      weight_decay=hyper.weight_decay, bc1=bc1, bc2=bc2, grad_scale=grad_scale,
      bc1_next=bc1_next if hyper.nesterov else None)


def optax_trajectory(hyper: Hyper, master, grads, decay_limit: int, mu_dtype=None):
  """Runs jit(optax.adamw) over `grads` (f32, already scaled); returns per step
  (params, mu, nu) as flat numpy arrays.

  With 0 < decay_limit < S the vector is cut into a decayed and an undecayed leaf (the
  way the core packs leaves); otherwise optax sees one flat leaf, and its XLA program
  is the one the kernels reproduce bit for bit (XLA rewrites the math of multi-leaf
  programs differently, see test_reference_vs_optax_with_a_decay_boundary).
  """
  size = master.shape[0]
  if 0 < decay_limit < size:
    split = lambda x: {'decayed': x[:decay_limit], 'rest': x[decay_limit:]}
    join = lambda t: np.concatenate([np.asarray(t['decayed']), np.asarray(t['rest'])])
    mask = {'decayed': True, 'rest': False}
  else:
    split, join, mask = (lambda x: x), np.asarray, None
  weight_decay = hyper.weight_decay if decay_limit > 0 else 0.0
  opt = optax.adamw(hyper.lr, hyper.b1, hyper.b2, hyper.eps, hyper.eps_root,
                    mu_dtype=mu_dtype, weight_decay=weight_decay, mask=mask,
                    nesterov=hyper.nesterov)

  @jax.jit
  def step(params, state, grad):
    updates, state = opt.update(split(grad), state, params)
    return optax.apply_updates(params, updates), state

  params = split(jnp.asarray(master))
  state = opt.init(params)
  out = []
  for grad in grads:
    params, state = step(params, state, jnp.asarray(grad, jnp.float32))
    adam = state[0]
    out.append((join(params), join(adam.mu), join(adam.nu)))
  return out


def random_state(rng: np.random.Generator, size: int, mu_dtype=jnp.float32):
  """A plausible mid-training state: weights ~N(0,1), m ~1e-3, v ~1e-6."""
  master = rng.standard_normal(size).astype(np.float32)
  mu = (rng.standard_normal(size) * 1e-3).astype(np.float32)
  nu = (rng.random(size) * 1e-6).astype(np.float32)
  return jnp.asarray(master), jnp.asarray(mu, mu_dtype), jnp.asarray(nu)


def random_grad(rng: np.random.Generator, size: int, dtype=jnp.float32):
  return jnp.asarray((rng.standard_normal(size) * 1e-2).astype(np.float32), dtype)


def assert_trees_equal(actual, expected):
  for a, e in zip(actual, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_close_to_optax(state, expected, lr):
  """(master, mu, nu) within rtol 1e-6, with absolute slack where values cancel.

  Differently compiled programs of the same math (XLA contracts a different product
  into an FMA, or folds constants) differ by an ulp in the inputs of a cancelling sum:
  new weights near 0 get 1e-6 of the step size lr; m and v, sums of two terms, get
  1e-6 of the array's largest magnitude.
  """
  for got, want, name in zip(state, expected, ('master', 'mu', 'nu')):
    # A bf16 m stores the f32 result rounded: an ulp of f32 may flip one bf16 rounding.
    rtol = 2**-7 if want.dtype == jnp.bfloat16 else 1e-6  # one bf16 ulp
    want = np.asarray(want, np.float32)
    atol = 1e-6 * (lr if name == 'master' else float(np.max(np.abs(want))))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=atol,
                               err_msg=name)


def check_across_decay_boundary(update, hyper: Hyper, size: int, limit: int, seed: int,
                                steps: int):
  """Runs `update(hyper, count, state, grad, decay_limit=...)` for `steps` steps on fresh
  random data and compares every step with optax (which sees two leaves)."""
  rng = np.random.default_rng(seed)
  master = random_state(rng, size)[0]
  grads = [random_grad(rng, size) for _ in range(steps)]
  expected = optax_trajectory(hyper, master, grads, limit)
  state = (master, jnp.zeros(size), jnp.zeros(size))
  for count, (grad, want) in enumerate(zip(grads, expected), start=1):
    *state, _ = update(hyper, count, state, grad, decay_limit=limit)
    assert_close_to_optax(state, want, hyper.lr)


def test_one_minus_follows_optax_python_float_arithmetic():
  # optax computes (1 - b1) in double for a Python float: 0.1f, not 1f - 0.9f.
  coeffs = adamw_scalars.coefficients(step_scalars(Hyper(), 1), nesterov=False)
  assert coeffs.one_minus_b1 == np.float32(1.0 - 0.9)
  assert coeffs.one_minus_b1 != np.float32(1) - np.float32(0.9)
  traced = dataclasses.replace(step_scalars(Hyper(), 1), b1=jnp.float32(0.9))
  coeffs = adamw_scalars.coefficients(traced, nesterov=False)
  assert coeffs.one_minus_b1 == np.float32(1) - np.float32(0.9)


def test_pack_keeps_field_order(seed):
  rng = np.random.default_rng(seed)
  coeffs = adamw_scalars.Coefficients(*rng.random(len(adamw_scalars.Coefficients._fields),
                                                  dtype=np.float32))
  packed = np.asarray(adamw_scalars.pack(coeffs))
  assert packed.shape == (adamw_scalars.NUM_SLOTS,)
  np.testing.assert_array_equal(packed[:len(coeffs)], np.asarray(coeffs))
  np.testing.assert_array_equal(packed[len(coeffs):], 0)


def test_scalars_are_a_pytree():
  scalars = step_scalars(Hyper(), 3)
  leaves = jax.tree.leaves(scalars)
  assert len(leaves) == 9  # bc1_next=None is an empty subtree
  rebuilt = jax.tree.unflatten(jax.tree.structure(scalars), leaves)
  assert rebuilt == scalars


def test_nesterov_without_bc1_next_is_a_clear_error():
  with pytest.raises(ValueError, match='bc1_next'):
    adamw_scalars.coefficients(step_scalars(Hyper(), 1), nesterov=True)


@pytest.mark.parametrize('culprit, kwargs', [
    ('mu', dict(mu=jnp.zeros(8, jnp.float16))),
    ('grad', dict(grad=jnp.zeros(9))),
    ('master', dict(master=jnp.zeros((2, 4)))),
    ('lowp_dtype', dict(lowp_dtype=jnp.int8)),
    ('decay_limit', dict(decay_limit=jnp.zeros(2, jnp.int32))),
])
def test_bad_inputs_name_the_culprit(culprit, kwargs):
  args = dict(master=jnp.zeros(8), mu=jnp.zeros(8), nu=jnp.zeros(8), grad=jnp.zeros(8),
              decay_limit=8, lowp_dtype=jnp.bfloat16)
  args.update(kwargs)
  with pytest.raises(ValueError, match=culprit):
    kernels.adamw_reference(args.pop('master'), args.pop('mu'), args.pop('nu'),
                            args.pop('grad'), step_scalars(Hyper(), 1), **args)


def _reference_trajectory(hyper, master, grads, decay_limit):
  state = (master, jnp.zeros_like(master), jnp.zeros_like(master))
  out = []
  for count, grad in enumerate(grads, start=1):
    scalars = step_scalars(hyper, count)
    step = jax.jit(lambda m, a, b, g, s=scalars: kernels.adamw_reference(
        m, a, b, g, s, decay_limit=decay_limit, lowp_dtype=jnp.bfloat16))
    *state, lowp = step(*state, grad)
    np.testing.assert_array_equal(np.asarray(lowp), np.asarray(state[0].astype(jnp.bfloat16)))
    out.append(state)
  return out


def _divides_by_a_product(hlo: str) -> bool:
  """Whether a compiled program divides by a product: XLA's algebraic simplifier turned
  (m / bc1) / (sqrt(.) + eps) into m / (bc1 * (sqrt(.) + eps))."""
  products = set(re.findall(r'(%[\w.-]+) = \S+ multiply\(', hlo))
  return any(d in products for d in re.findall(r'= \S+ divide\(%[\w.-]+, (%[\w.-]+)\)', hlo))


@pytest.mark.parametrize('decay', [True, False])
def test_reference_matches_optax_bit_for_bit(decay, seed):
  # On one flat leaf the jitted reference is the same XLA program as optax's, where XLA
  # keeps optax's order of divisions (jax 0.10 to 0.12.0); jax 0.12.1's XLA also rewrites
  # the one-leaf program's divisions (as it does two leaves',
  # test_reference_vs_optax_with_a_decay_boundary): there, the rewrite is read from
  # optax's compiled program and the tolerance is that test's.
  hyper, size = Hyper(), 1003
  rng = np.random.default_rng(seed)
  master = random_state(rng, size)[0]
  grads = [random_grad(rng, size) for _ in range(3)]
  limit = size if decay else 0
  expected = optax_trajectory(hyper, master, grads, limit)
  opt = optax.adamw(hyper.lr, hyper.b1, hyper.b2, hyper.eps, hyper.eps_root,
                    weight_decay=hyper.weight_decay if decay else 0.0)
  optax_hlo = jax.jit(lambda p, s, g: opt.update(g, s, p)).lower(
      master, opt.init(master), grads[0]).compile().as_text()
  rewritten = _divides_by_a_product(optax_hlo)
  for got, want in zip(_reference_trajectory(hyper, master, grads, limit), expected):
    if rewritten:
      assert_close_to_optax(got, want, hyper.lr)
    else:
      assert_trees_equal(got, want)


def test_reference_vs_optax_with_a_decay_boundary(seed):
  # Two leaves: XLA's algebraic simplifier then keeps `x / bc` as a division and turns
  # (m / bc1) / (sqrt(.) + eps) into m / (bc1 * (sqrt(.) + eps)), so optax itself
  # differs by an ulp here and there from its one-leaf program; rtol 1e-6 holds.
  hyper, size, limit = Hyper(), 1003, 600
  rng = np.random.default_rng(seed)
  master = random_state(rng, size)[0]
  grads = [random_grad(rng, size) for _ in range(3)]
  expected = optax_trajectory(hyper, master, grads, limit)
  for got, want in zip(_reference_trajectory(hyper, master, grads, limit), expected):
    assert_close_to_optax(got, want, hyper.lr)
