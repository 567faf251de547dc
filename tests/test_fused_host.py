"""The native host path of dos_jax.adamw (`Implementation(host=UpdateImpl.KERNEL)`)
against the XLA host path."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.step import kernel_calls
from dos_jax.kernels import host_adamw_rows

from tests.test_adamw import decay_mask
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree
from tests.test_adamw import SCHEDULE

pytestmark = pytest.mark.skipif(
    not host_adamw_rows.rows_kernel_available(),
    reason=f'not available: {host_adamw_rows.rows_kernel_unavailable_reason()}')

KERNEL, XLA = dos_jax.UpdateImpl.KERNEL, dos_jax.UpdateImpl.XLA
# The row kernel's custom-call targets (packed rows, or gradients read from leaves).
TARGET = re.compile(r'dos_jax_adamw_host_(rows|leaves)')
POLICIES = [dos_jax.AllHost(), dos_jax.Stride(2),
            dos_jax.DeviceFraction(0.4), dos_jax.AllDevice()]


def _in_place_everywhere(in_place, with_result):
  """`kernel_calls.state_in_place` choosing the GPU program's form on every platform."""
  del with_result
  return in_place


def _offload(policy, subgroup_size=23):
  return dos_jax.Offload(subgroup_size=subgroup_size, policy=policy)


def _host(impl, **kwargs):
  """The `Implementation` with the host path's `impl` (the rest as `kwargs` say)."""
  return dos_jax.Implementation(host=impl, **kwargs)


def _trajectory(opt, params, steps: int, seed: int):
  """Runs `steps` jitted steps; returns (params, state, lowered text, cache sizes)."""
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  text = step.lower(params, state, params).as_text()
  sizes = []
  for i in range(steps):
    params, state = step(params, state, random_grads(params, i, seed))
    sizes.append(step._cache_size())  # pylint: disable=protected-access
  return params, state, text, sizes


# The kernel reproduces the FMA contractions XLA 0.10's CPU compiler makes for the AdamW
# moments (host_adamw_rows.cc). Newer XLA contracts some of them otherwise when the
# gradients arrive as bf16, so there the XLA host path is the kernel's equal within the
# tolerances optax is held to (the kernel's own references, optax and numpy, are in
# test_kernels_host*.py and test_adamw.py).
_XLA_ROUNDS_AS_THE_KERNEL = tuple(int(v) for v in jax.__version__.split('.')[:2]) < (0, 11)


def _assert_matches_xla_path(a, b):
  """Bit for bit on jax 0.10; within optax's test tolerances on newer jax."""
  if _XLA_ROUNDS_AS_THE_KERNEL:
    _assert_bit_equal(a, b)
    return
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    if not jnp.issubdtype(x.dtype, jnp.floating):
      np.testing.assert_array_equal(x, y)
      continue
    # One ulp of the dtype relative (bf16 params), fp32 rounding carried over a few
    # steps otherwise: the tolerances test_adamw.py holds optax to.
    rtol = max(1e-5, 2.0 ** -jnp.finfo(x.dtype).nmant)
    np.testing.assert_allclose(np.atleast_1d(x).astype(np.float32),
                               np.atleast_1d(y).astype(np.float32), rtol=rtol, atol=1e-6)


def _assert_bit_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8),
                                  np.atleast_1d(y).view(np.uint8))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', POLICIES, ids=repr)
def test_kernel_path_is_bit_identical_to_xla_host_path(policy, dtype, seed):
  """Every policy with the native kernel equals the XLA host loop bit for bit. (The
  reference updates every row in the XLA host loop, AllHost: XLA compiles the
  streamed device loop with other FMA contractions, within an ulp of it.)"""
  params = random_tree(seed, dtype)
  results = {}
  for impl, p in ((KERNEL, policy), (XLA, dos_jax.AllHost())):
    opt = dos_jax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask,
                        offload=_offload(p), implementation=_host(impl))
    results[impl] = _trajectory(opt, params, steps=6, seed=seed)
  (p_k, s_k, text_k, sizes_k), (p_x, s_x, text_x, _) = results[KERNEL], results[XLA]
  _assert_matches_xla_path((p_k, s_k.rows(), s_k.scalars), (p_x, s_x.rows(), s_x.scalars))
  resident = isinstance(policy, dos_jax.AllDevice)
  # On a CPU backend the device rows take the native call too (device memory is host
  # memory); with the XLA host path nothing does.
  assert TARGET.search(text_k)
  assert not TARGET.search(text_x)
  # The first step's state comes from init; after that one plan never recompiles.
  assert len(set(sizes_k[1:])) == 1, sizes_k
  assert {x.sharding.memory_kind for x in jax.tree.leaves(s_k.tiers) if x.shape[0]} == (
      {'device'} if resident else {'pinned_host'})


@pytest.mark.parametrize('make', [
    lambda o: dos_jax.adamw(1e-2, mu_dtype=jnp.bfloat16, offload=o),
    lambda o: dos_jax.adamw(1e-2, nesterov=True, offload=o),
    lambda o: dos_jax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1),
                            optax.scale_by_learning_rate(1e-2), offload=o),
], ids=['bf16_mu', 'nesterov', 'chain'])
def test_xla_path_where_the_kernel_does_not_apply(make, seed):
  params = random_tree(seed)
  text = _trajectory(make(_offload(dos_jax.AllHost())), params, 1, seed)[2]
  assert not TARGET.search(text)


def test_under_clipping_and_inject_hyperparams(seed):
  params = random_tree(seed, jnp.bfloat16)
  results = []
  for impl in (KERNEL, XLA):
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        # f32 hyperparameters: optax would cast them to the bf16 params' dtype, where
        # b2 = 0.999 rounds to 1 and the bias correction 1 - b2**t to 0.
        optax.inject_hyperparams(dos_jax.adamw, hyperparam_dtype=jnp.float32)(
            learning_rate=3e-2, b1=0.8, weight_decay=0.1,
            offload=_offload(dos_jax.Stride(2) if impl == KERNEL else dos_jax.AllHost()),
            implementation=_host(impl)))
    results.append(_trajectory(opt, params, steps=4, seed=seed))
  assert TARGET.search(results[0][2])
  kernel_state, xla_state = results[0][1][1].inner_state, results[1][1][1].inner_state
  assert np.isfinite(np.asarray(kernel_state.rows()[0])).all()
  # Params bit for bit. The fp32 state within one rounding of its terms: with
  # array-valued hyperparameters XLA contracts one product of the moment update into an
  # FMA by how the rest of the program is fused, which the kernel cannot follow in every
  # program. One rounding of the terms is many ulps of a value that cancels to near
  # zero, so the bound is one ulp of each field's (master, mu, nu) largest value.
  _assert_matches_xla_path(results[0][0], results[1][0])
  if _XLA_ROUNDS_AS_THE_KERNEL:
    ours, ref = np.asarray(kernel_state.rows()[0]), np.asarray(xla_state.rows()[0])
    bound = np.spacing(np.abs(ref).max(axis=(0, 2), keepdims=True))
    assert (np.abs(ours - ref) <= bound).all(), np.abs(ours - ref).max(axis=(0, 2))
  else:
    _assert_matches_xla_path(kernel_state.rows()[0], xla_state.rows()[0])


@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2)], ids=repr)
def test_no_state_sized_temporary(policy):
  """With params and state donated, the native host path adds no temporary beyond the
  new parameter rows (gradients are read from their leaves), never a copy of the state."""
  params = {'a': jnp.zeros((600, 500), jnp.bfloat16), 'b': jnp.zeros((70_001,), jnp.bfloat16)}
  temps = {}
  for impl in (KERNEL, XLA):
    opt = dos_jax.adamw(1e-3, offload=_offload(policy, subgroup_size=40_000),
                        implementation=_host(impl))
    state = opt.init(params)

    def step(p, s, g, opt=opt):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    assert bool(TARGET.search(compiled.as_text())) == (impl == KERNEL)
    temps[impl] = compiled.memory_analysis().temp_size_in_bytes
  rows_bytes = state.layout.num_subgroups * state.layout.subgroup_size * 2  # bf16 rows
  # The streamed device rows have temporaries of their own (the same on both paths).
  assert temps[KERNEL] <= temps[XLA], temps
  if isinstance(policy, dos_jax.AllHost):
    # 12-byte-per-element state: 4.8 MB; the new bf16 rows: 0.8 MB.
    assert temps[KERNEL] <= rows_bytes + (1 << 16), (temps, rows_bytes)


def test_mixed_gradient_dtypes_stay_on_the_xla_path(seed):
  """XLA rounds by the gradient's own dtype; with mixed leaves the XLA path is kept."""
  params = random_tree(seed)
  params['emb'] = params['emb'].astype(jnp.bfloat16)
  opt = dos_jax.adamw(1e-2, offload=_offload(dos_jax.AllHost()))
  assert not TARGET.search(_trajectory(opt, params, 1, seed)[2])


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2)], ids=repr)
def test_accelerator_form_on_cpu(policy, dtype, seed):
  """The two-memory program (host gradients copied to host memory piece by piece, the
  native call in a host region, out rows copied back), run on the CPU backend: the same
  results as the XLA path of the CPU program (its host rows and their params bit for
  bit on jax 0.10; its streamed rows and their params within an ulp)."""
  params = random_tree(seed, dtype)
  results = []
  for impl in (KERNEL, XLA):
    # The device rows stay on XLA here; the Pallas device path has its own test.
    implementation = _host(impl, device=XLA, program='gpu' if impl == KERNEL else 'cpu')
    opt = dos_jax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask,
                        offload=_offload(policy), implementation=implementation)
    results.append(_trajectory(opt, params, steps=4, seed=seed))
  assert 'dos_jax_adamw_host_leaves' in results[0][2]
  state, reference = results[0][1], results[1][1]
  host = list(policy.plan(state.layout.spec()).host)
  streamed = [g for g in range(state.layout.spec().num_subgroups) if g not in host]
  pick = lambda rows, ids: tuple(np.asarray(r)[ids] for r in rows)
  # The params by subgroup: a (G, S) array, each row the params of one subgroup.
  param_rows = lambda p: np.asarray(dos_jax.geometry.layout.pack(p, state.layout, dtype))
  _assert_matches_xla_path((param_rows(results[0][0])[host], pick(state.rows(), host)),
                           (param_rows(results[1][0])[host], pick(reference.rows(), host)))
  # The streamed rows run XLA's row update in the stream lanes, which XLA compiles with
  # other FMA contractions than the one-memory program (the fetch is not fused with the
  # moments' arithmetic): within an ulp, and so are their params.
  for got, want in zip(pick(state.rows(), streamed), pick(reference.rows(), streamed)):
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-5,
                               atol=1e-7)
  ulp = max(1e-5, 2.0 ** -jnp.finfo(dtype).nmant)
  np.testing.assert_allclose(param_rows(results[0][0])[streamed].astype(np.float32),
                             param_rows(results[1][0])[streamed].astype(np.float32),
                             rtol=ulp, atol=1e-7)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2)], ids=repr)
def test_accelerator_form_updates_the_donated_state_in_place(policy, dtype, monkeypatch, seed):
  """The GPU program's form of the host update (the kernel writes the state in its
  argument's buffer, the region returns only the out rows), run on the CPU backend with
  the state donated, as a train step does: bit for bit the results of the same program
  returning the state from the region (what a CPU backend runs, see
  `kernel_calls.state_in_place`), which `test_accelerator_form_on_cpu` compares with
  the XLA host path."""
  params = random_tree(seed, dtype)
  opt = dos_jax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask, offload=_offload(policy),
                      implementation=_host(KERNEL, device=XLA, program='gpu'))

  def run(opt):
    def step(p, s, g):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(1,))
    p, state = params, opt.init(params)
    text = step.lower(p, state, p).as_text()
    for i in range(4):
      p, state = step(p, state, random_grads(params, i, seed))
    return (p, state.rows()), text

  with_result, text = run(opt)
  assert 'dos_jax_adamw_host_leaves_state_arg' not in text
  monkeypatch.setattr(kernel_calls, 'state_in_place', _in_place_everywhere)
  in_place, text = run(opt)
  assert 'dos_jax_adamw_host_leaves_state_arg' in text
  _assert_bit_equal(in_place, with_result)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', [dos_jax.Stride(1), dos_jax.Stride(2)], ids=repr)
def test_pallas_device_path_matches_xla(policy, dtype, seed):
  """The two-memory program's device path: each streamed subgroup updated by the Pallas
  AdamW (interpret mode on the CPU backend), against the XLA path.
  Tolerance: the kernels agree with optax to rtol 1e-6 per step (kernel tests)."""
  params = random_tree(seed, dtype)
  results = []
  for impl in (KERNEL, XLA):
    opt = dos_jax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask, offload=_offload(policy),
                        implementation=_host(XLA, device=impl, program='gpu'))
    results.append(_trajectory(opt, params, steps=3, seed=seed))
  # The Pallas AdamW ran: the program calls its jitted entry (kernels/pallas_adamw.py's
  # `_adamw_rows_call`, a function of its own in the lowered text); the XLA path's does not.
  assert 'call @_adamw_rows_call' in results[0][2]
  assert '_adamw_rows_call' not in results[1][2]
  for x, y in zip(jax.tree.leaves((results[0][0], results[0][1].rows())),
                  jax.tree.leaves((results[1][0], results[1][1].rows()))):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=1e-5, atol=1e-6)
  assert results[0][3][-1] == results[0][3][1]  # no recompilation after the first steps


@pytest.mark.parametrize('seed', [7])
def test_adamw_scalars_cross_into_host_regions_as_one_vector(seed):
  """Each array a host region takes costs XLA's host offloader a walk of the program
  (experiments/RESULTS.md, `construction-compile-g-both`): the step's float32 scalars
  cross as one vector, and come back out bit for bit; scalars of another dtype cross
  as they are."""
  values = np.random.default_rng(seed).random(4).astype(np.float32)
  scalars = kernel_calls.AdamWScalars(
      lr=jnp.asarray(values[0]), b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
      weight_decay=1e-4, bc1=jnp.asarray(values[1]), bc2=jnp.asarray(values[2]),
      grad_scale=jnp.asarray(values[3]))
  arrays, join = kernel_calls.split_scalars(scalars)
  assert [a.shape for a in arrays] == [(4,)], f'seed {seed}'
  joined = jax.jit(join)(arrays)
  for field in ('lr', 'bc1', 'bc2', 'grad_scale'):
    np.testing.assert_array_equal(getattr(joined, field), getattr(scalars, field))
  assert (joined.b1, joined.weight_decay) == (0.9, 1e-4)  # Python floats stay closed over
  mixed = dataclasses.replace(scalars, grad_scale=jnp.asarray(values[3], jnp.bfloat16))
  arrays, join = kernel_calls.split_scalars(mixed)
  assert [a.dtype for a in arrays] == [jnp.float32] * 3 + [jnp.bfloat16]
  assert join(arrays).grad_scale.dtype == jnp.bfloat16
