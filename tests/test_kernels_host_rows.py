"""Tests of the row-wise native host AdamW against optax and itself."""

from __future__ import annotations

import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax import kernels
from dos_jax.kernels import host_adamw_rows
from dos_jax.kernels.host_adamw_rows import adamw_host_rows
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars

_MUST_HAVE = platform.system() == 'Linux' and platform.machine() in ('x86_64', 'AMD64')

pytestmark = pytest.mark.skipif(
    not _MUST_HAVE and not host_adamw_rows.rows_kernel_available(),
    reason=f'not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')

MASTER = (0, 2, 1)  # (master_k, mu_k, nu_k): not the natural order, to catch mix-ups
NO_MASTER = (-1, 1, 0)


def test_available_on_x86_64_linux():
  if _MUST_HAVE:
    assert host_adamw_rows.rows_kernel_available(), (
        host_adamw_rows.rows_kernel_unavailable_reason())


def random_stacked(rng, groups: int, size: int, slots) -> np.ndarray:
  """A plausible mid-training state (weights ~N(0,1), m ~1e-3, v ~1e-6) in `slots`."""
  master_k, mu_k, nu_k = slots
  stacked = np.empty((groups, 3 if master_k >= 0 else 2, size), np.float32)
  if master_k >= 0:
    stacked[:, master_k] = rng.standard_normal((groups, size))
  stacked[:, mu_k] = rng.standard_normal((groups, size)) * 1e-3
  stacked[:, nu_k] = rng.random((groups, size)) * 1e-6
  return stacked


def optax_row(hyper: Hyper, count: int, param, mu, nu, grad, decayed: bool):
  """jit(optax.adamw) on one flat row, the gradient cast to f32 inside the program (as
  the core does); returns (new_param, update, mu, nu) as numpy."""
  opt = optax.adamw(hyper.lr, hyper.b1, hyper.b2, hyper.eps, hyper.eps_root,
                    weight_decay=hyper.weight_decay if decayed else 0.0,
                    nesterov=hyper.nesterov)

  @jax.jit
  def step(p, mu, nu, g):
    state = opt.init(p)
    state = (state[0]._replace(count=jnp.int32(count - 1), mu=mu, nu=nu),) + state[1:]
    u, state = opt.update(g.astype(jnp.float32), state, p)
    return optax.apply_updates(p, u), u, state[0].mu, state[0].nu

  return tuple(np.asarray(x) for x in step(param, mu, nu, grad))


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _run(hyper, count, stacked, grads, params, rows, slots, decayed_rows, lowp, **kw):
  return adamw_host_rows(
      jnp.asarray(stacked), grads, params, jnp.asarray(rows, jnp.int32),
      step_scalars(hyper, count), slots=slots, decayed_rows=decayed_rows,
      lowp_dtype=lowp, nesterov=hyper.nesterov, **kw)


def _check_rows(hyper, groups, size, rows, master, grad_dtype, *, exact):
  rng = np.random.default_rng(size * 7 + len(rows))
  slots = MASTER if master else NO_MASTER
  stacked = random_stacked(rng, groups, size, slots)
  decayed_rows = int(rng.integers(0, groups + 1))
  grads = jnp.asarray(rng.standard_normal((len(rows), size)) * 1e-2, grad_dtype)
  params = None if master else jnp.asarray(rng.standard_normal((len(rows), size)),
                                           jnp.float32)
  lowp = jnp.bfloat16 if master else jnp.float32
  count = int(rng.integers(1, 50))
  new, out = _run(hyper, count, stacked, grads, params, rows, slots, decayed_rows, lowp)
  new = np.asarray(new)
  master_k, mu_k, nu_k = slots
  for j, g in enumerate(rows):
    p = stacked[g, master_k] if master else params[j]
    want_p, want_u, want_mu, want_nu = optax_row(
        hyper, count, p, stacked[g, mu_k], stacked[g, nu_k], grads[j], g < decayed_rows)
    checks = [(new[g, mu_k], want_mu, 'mu', 1e-3), (new[g, nu_k], want_nu, 'nu', 1e-6)]
    if master:
      checks.append((new[g, master_k], want_p, 'master', hyper.lr))
      np.testing.assert_array_equal(_bits(out[j]), _bits(want_p.astype(jnp.bfloat16)))
    else:
      checks.append((out[j], want_u, 'update', hyper.lr))
    for got, want, name, scale in checks:
      if exact:
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f'{name} of row {g}')
      else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6 * scale,
                                   err_msg=f'{name} of row {g}')


# Sizes: odd, and 4 x 70_001 elements, which really use two threads.
@pytest.mark.parametrize('groups,size,rows', [(5, 7, [4, 0, 2]), (6, 70_001, [5, 1, 2, 0])])
@pytest.mark.parametrize('master', [True, False], ids=['master', 'no_master'])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_matches_optax_row_by_row_bit_for_bit(groups, size, rows, master, grad_dtype):
  _check_rows(Hyper(), groups, size, rows, master, grad_dtype, exact=True)


# XLA compiles Nesterov's sum, and programs on 1-element arrays, with other FMA
# contractions than the kernel's: an ulp apart, hence a tolerance here.
@pytest.mark.parametrize('groups,size,rows,nesterov', [(3, 1, [1], False), (3, 1, [2, 0], True),
                                                       (4, 5000, [3, 1], True)])
@pytest.mark.parametrize('master', [True, False], ids=['master', 'no_master'])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_nesterov_and_one_element_rows_close_to_optax(groups, size, rows, nesterov, master,
                                                      grad_dtype):
  _check_rows(Hyper(nesterov=nesterov), groups, size, rows, master, grad_dtype, exact=False)


@pytest.mark.parametrize('master', [True, False], ids=['master', 'no_master'])
def test_only_listed_rows_change(master, seed):
  rng = np.random.default_rng(seed)
  groups, size, rows = 7, 33_333, [6, 2, 3]
  slots = MASTER if master else NO_MASTER
  stacked = random_stacked(rng, groups, size, slots)
  others = [g for g in range(groups) if g not in rows]
  stacked[others] = np.nan  # poison: any read of these rows would spread NaNs
  stacked[others, 0, :5] = [1.5, -0.0, np.inf, 3e-39, 7.0]  # odd bit patterns
  grads = jnp.asarray(rng.standard_normal((groups, size)) * 1e-2, jnp.float32)
  params = None if master else jnp.asarray(rng.standard_normal((groups, size)), jnp.float32)
  lowp = jnp.bfloat16 if master else jnp.float32
  out = jnp.full((groups, size), -3.25, lowp)
  new, new_out = _run(Hyper(), 2, stacked, grads, params, rows, slots, groups, lowp,
                      out=out, indexed=True)
  np.testing.assert_array_equal(_bits(np.asarray(new)[others]), _bits(stacked[others]))
  np.testing.assert_array_equal(np.asarray(new_out)[others], np.asarray(out)[others])
  assert np.isfinite(np.asarray(new)[rows]).all()
  assert np.isfinite(np.asarray(new_out, np.float32)[rows]).all()


@pytest.mark.parametrize('master', [True, False], ids=['master', 'no_master'])
def test_indexed_form_equals_gathered_form(master, seed):
  rng = np.random.default_rng(seed)
  groups, size, rows = 6, 9_001, [5, 0, 3]
  slots = MASTER if master else NO_MASTER
  stacked = random_stacked(rng, groups, size, slots)
  grads = jnp.asarray(rng.standard_normal((groups, size)) * 1e-2, jnp.bfloat16)
  params = None if master else jnp.asarray(rng.standard_normal((groups, size)), jnp.float32)
  lowp = jnp.float16 if master else jnp.float32
  order = np.asarray(rows)
  gathered = _run(Hyper(), 4, stacked, grads[order], None if master else params[order],
                  rows, slots, 4, lowp)
  indexed = _run(Hyper(), 4, stacked, grads, params, rows, slots, 4, lowp,
                 out=jnp.zeros((groups, size), lowp), indexed=True)
  np.testing.assert_array_equal(np.asarray(gathered[0]), np.asarray(indexed[0]))
  np.testing.assert_array_equal(_bits(gathered[1]), _bits(np.asarray(indexed[1])[order]))


def test_thread_counts_and_isas_agree_bit_for_bit(seed):
  rng = np.random.default_rng(seed)
  groups, size, rows = 4, 50_001, [2, 0, 3]
  stacked = random_stacked(rng, groups, size, MASTER)
  grads = jnp.asarray(rng.standard_normal((len(rows), size)) * 1e-2, jnp.bfloat16)
  results = [
      _run(Hyper(), 2, stacked, grads, None, rows, MASTER, 2, jnp.bfloat16,
           num_threads=threads, isa=isa)
      for threads in (1, 3) for isa in kernels.supported_isas()
  ]
  for new, out in results[1:]:
    np.testing.assert_array_equal(np.asarray(new), np.asarray(results[0][0]))
    np.testing.assert_array_equal(_bits(out), _bits(results[0][1]))


def test_in_place_under_jit_with_donation(seed):
  groups, size = 8, 50_000
  rng = np.random.default_rng(seed)
  scalars = step_scalars(Hyper(), 1)

  @functools.partial(jax.jit, donate_argnums=(0, 2))
  def step(stacked, grads, out):
    return adamw_host_rows(stacked, grads, None, jnp.arange(0, groups, 2), scalars,
                           slots=MASTER, decayed_rows=groups, lowp_dtype=jnp.bfloat16,
                           out=out, indexed=True)

  stacked = jnp.asarray(random_stacked(rng, groups, size, MASTER))
  grads = jnp.asarray(rng.standard_normal((groups, size)) * 1e-2, jnp.bfloat16)
  out = jnp.zeros((groups, size), jnp.bfloat16)
  compiled = step.lower(stacked, grads, out).compile()
  memory = compiled.memory_analysis()
  # No copy of the state (stacked.nbytes = 9.6 MB) nor of out: only the tiny operands.
  assert memory.temp_size_in_bytes < 1 << 16, memory
  assert memory.alias_size_in_bytes == stacked.nbytes + out.nbytes
  before = stacked.unsafe_buffer_pointer()
  stacked, out = step(stacked, grads, out)
  assert stacked.unsafe_buffer_pointer() == before


def test_not_donated_copies_the_state_first(seed):
  """Without donation XLA does not alias: the kernel copies the state, the input keeps
  its values and the result is the same as in place."""
  rng = np.random.default_rng(seed)
  stacked = jnp.asarray(random_stacked(rng, 3, 70_000, MASTER))
  grads = jnp.asarray(rng.standard_normal((3, 70_000)) * 1e-2, jnp.float32)
  keep = np.asarray(stacked).copy()
  new, _ = jax.jit(lambda s, g: _run(Hyper(), 1, s, g, None, [1, 2], MASTER, 3,
                                     jnp.bfloat16, indexed=False, out=None))(stacked,
                                                                           grads[1:])
  np.testing.assert_array_equal(np.asarray(stacked), keep)
  np.testing.assert_array_equal(np.asarray(new)[0], keep[0])
  assert not np.array_equal(np.asarray(new)[1:], keep[1:])


def test_bad_inputs_are_clear_errors():
  stacked = jnp.zeros((4, 3, 8))
  grads = jnp.zeros((2, 8))
  run = functools.partial(adamw_host_rows, scalars=step_scalars(Hyper(), 1),
                          decayed_rows=4, lowp_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match='grads must be'):
    run(stacked, jnp.zeros((3, 8)), None, jnp.array([0, 1]), slots=MASTER)
  with pytest.raises(ValueError, match='slots='):
    run(stacked, grads, None, jnp.array([0, 1]), slots=(0, 1, 1))
  with pytest.raises(ValueError, match='params must be'):
    run(stacked[:, :2], grads, None, jnp.array([0, 1]), slots=NO_MASTER)
  with pytest.raises(ValueError, match='lowp_dtype must be float32'):
    run(stacked[:, :2], grads, grads, jnp.array([0, 1]), slots=NO_MASTER)
  with pytest.raises(ValueError, match='out must be'):
    run(stacked, grads, None, jnp.array([0, 1]), slots=MASTER, out=jnp.zeros((2, 8)))
  with pytest.raises(ValueError, match='num_threads'):
    run(stacked, grads, None, jnp.array([0, 1]), slots=MASTER, num_threads=0)
  # Row indices are data: checked by the kernel when it runs.
  with pytest.raises(Exception, match='rows must be distinct'):
    jax.block_until_ready(run(stacked, grads, None, jnp.array([1, 1]), slots=MASTER))
  with pytest.raises(Exception, match='rows must be distinct'):
    jax.block_until_ready(run(stacked, grads, None, jnp.array([0, 4]), slots=MASTER))


# Leaves of a (5, 1000) layout: listed out of order, with padding gaps between them, one
# leaf crossing two subgroup boundaries, one ending a subgroup exactly.
LEAF_SHAPES = ((300,), (40, 10), (7,), (1200,), (2, 100))
LEAF_OFFSETS = (1500, 0, 420, 2100, 3800)


def _leaves_case(rng, master, grad_dtype):
  groups, size = 5, 1000
  slots = MASTER if master else NO_MASTER
  stacked = random_stacked(rng, groups, size, slots)
  covered = np.zeros(groups * size, bool)
  for shape, off in zip(LEAF_SHAPES, LEAF_OFFSETS):
    covered[off:off + int(np.prod(shape))] = True
  padding = ~covered.reshape(groups, 1, size)
  stacked[np.broadcast_to(padding, stacked.shape)] = 0  # as the layout keeps it
  grads = [jnp.asarray(rng.standard_normal(s) * 1e-2, grad_dtype) for s in LEAF_SHAPES]
  params = None if master else [jnp.asarray(rng.standard_normal(s), jnp.float32)
                                for s in LEAF_SHAPES]

  def pack(leaves, dtype):
    flat = np.zeros(groups * size, np.float32)
    for leaf, off in zip(leaves, LEAF_OFFSETS):
      flat[off:off + leaf.size] = np.asarray(leaf, np.float32).ravel()
    return jnp.asarray(flat.reshape(groups, size), dtype)

  packed = (pack(grads, grad_dtype), None if master else pack(params, jnp.float32))
  return stacked, grads, params, packed, covered.reshape(groups, size)


@pytest.mark.parametrize('master', [True, False], ids=['master', 'no_master'])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_leaves_form_equals_packed_rows(master, grad_dtype, seed):
  rng = np.random.default_rng(seed)
  stacked, grads, params, (packed_g, packed_p), covered = _leaves_case(rng, master, grad_dtype)
  slots = MASTER if master else NO_MASTER
  lowp = jnp.bfloat16 if master else jnp.float32
  rows = jnp.asarray([3, 0, 1], jnp.int32)
  common = dict(slots=slots, decayed_rows=2, lowp_dtype=lowp)
  scalars = step_scalars(Hyper(), 5)
  want, want_out = adamw_host_rows(jnp.asarray(stacked), packed_g, packed_p, rows, scalars,
                                   out=jnp.zeros((5, 1000), lowp), indexed=True, **common)
  sentinel = jnp.full((5, 1000), 7.0, lowp)
  got, got_out = host_adamw_rows.adamw_host_leaves(
      jnp.asarray(stacked), grads, params, rows, scalars, offsets=LEAF_OFFSETS, out=sentinel,
      **common)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  listed = np.zeros_like(covered)
  listed[np.asarray(rows)] = True
  np.testing.assert_array_equal(_bits(np.asarray(got_out)[covered & listed]),
                                _bits(np.asarray(want_out)[covered & listed]))
  # Padding and unlisted rows of `out` are left as they were.
  assert (np.asarray(got_out, np.float32)[~(covered & listed)] == 7.0).all()
  np.testing.assert_array_equal(_bits(np.asarray(got)[2]), _bits(stacked[2]))


def test_leaves_form_bad_inputs_are_clear_errors():
  run = functools.partial(host_adamw_rows.adamw_host_leaves, jnp.zeros((2, 3, 8)),
                          scalars=step_scalars(Hyper(), 1), rows=jnp.array([0]),
                          slots=MASTER, decayed_rows=2, lowp_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match='overlap'):
    run([jnp.zeros(4), jnp.zeros(4)], None, offsets=(0, 3))
  with pytest.raises(ValueError, match='must all be f32 or all bf16'):
    run([jnp.zeros(4), jnp.zeros(4, jnp.bfloat16)], None, offsets=(0, 4))
  with pytest.raises(ValueError, match='beyond'):
    run([jnp.zeros(4)], None, offsets=(14,))
  with pytest.raises(ValueError, match='one offset per'):
    run([jnp.zeros(4)], None, offsets=(0, 4))
