"""dos_jax where users put an optax optimizer: flax NNX and linen, optax wrappers, orbax,
optax's tree utilities and flax serialization. Each against optax itself, on fresh
random inputs.

Tolerances: fp32 params rtol 1e-5 / atol 1e-6 against optax (same math, other fusion).
bf16 params: dos_jax runs AdamW on an fp32 master; the reference is optax.adamw on an
fp32 copy fed the same gradients. The masters agree to rtol 1e-6; the bf16 params are
the cast of the master except where a bf16 update rounds (see
`test_adamw.assert_params_track_master`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dos_jax
from tests.test_adamw import assert_params_track_master
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

OFFLOAD = dos_jax.Offload(subgroup_size=97, policy=dos_jax.Stride(2))
LR = 1e-2


def assert_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=rtol, atol=atol)


def memory_kinds(tree):
  """Memory kinds of the packed state's rows (the non-empty 3-d arrays)."""
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if jnp.ndim(x) == 3 and x.size}


def unpacked_master(state):
  return dos_jax.geometry.layout.unpack(jax.device_put(state.master, jax.devices()[0]), state.layout)


class MLP(nnx.Module):

  def __init__(self, dtype, rngs):
    self.l1 = nnx.Linear(24, 40, param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.l2 = nnx.Linear(40, 8, param_dtype=dtype, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.gelu(self.l1(x)))


def _nnx_run(make_tx, dtype, seed, steps):
  """Trains an MLP with nnx.Optimizer(make_tx()); returns (model, optimizer, grads fed)."""
  model = MLP(dtype, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  rng = np.random.default_rng(seed)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_fn = lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2)
    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)
    return grads

  fed = []
  for _ in range(steps):
    x = jnp.asarray(rng.standard_normal((16, 24)), dtype)
    y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    fed.append(train_step(model, optimizer, x, y))
  return model, optimizer, fed


@pytest.mark.parametrize('which', ['adamw', 'chain'])
def test_nnx_optimizer_fp32_equals_optax(which, seed):
  if which == 'adamw':
    ours = lambda: dos_jax.adamw(LR, weight_decay=0.05, offload=OFFLOAD)
    ref = lambda: optax.adamw(LR, weight_decay=0.05)
  else:
    members = lambda: (optax.clip_by_global_norm(0.5), optax.scale_by_adam(),
                       optax.add_decayed_weights(0.05), optax.scale_by_learning_rate(LR))
    ours = lambda: dos_jax.chain(*members(), offload=OFFLOAD)
    ref = lambda: optax.chain(*members())
  model, optimizer, _ = _nnx_run(ours, jnp.float32, seed, steps=6)
  ref_model, _, _ = _nnx_run(ref, jnp.float32, seed, steps=6)
  assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
  assert memory_kinds(nnx.state(optimizer)) == {'pinned_host'}


def test_nnx_optimizer_bf16_tracks_optax_on_an_fp32_master(seed):
  model, optimizer, fed = _nnx_run(
      lambda: dos_jax.adamw(LR, weight_decay=0.05, offload=OFFLOAD), jnp.bfloat16, seed, 6)
  # Reference: optax.adamw on fp32 copies of the initial bf16 params, fed the same grads.
  start = nnx.state(MLP(jnp.bfloat16, nnx.Rngs(seed)), nnx.Param)
  ref_p = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.to_pure_dict(start))
  ref = optax.adamw(LR, weight_decay=0.05)
  ref_s = ref.init(ref_p)
  for grads in fed:
    g = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.to_pure_dict(grads))
    u, ref_s = ref.update(g, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  opt_state = nnx.to_pure_dict(nnx.state(optimizer))['opt_state']
  state = jax.tree.unflatten(jax.tree.structure(optimizer.tx.init(start)),
                             jax.tree.leaves(opt_state))
  master = unpacked_master(state)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # Leaf order of the pure dicts is the init-time order the layout keeps.
  assert_close(master, jax.tree.leaves(ref_p), rtol=1e-6, atol=1e-7)
  assert_params_track_master(params, master, step_bound=4 * LR)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  assert memory_kinds(opt_state) == {'pinned_host'}


def test_linen_train_state_apply_gradients_equals_optax(seed):
  from flax.training import train_state  # pylint: disable=import-outside-toplevel
  params = random_tree(seed)

  def run(tx):
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for i in range(5):
      state = step(state, random_grads(params, i, seed))
    return state

  ours = run(dos_jax.adamw(LR, offload=OFFLOAD))
  ref = run(optax.adamw(LR))
  assert_close(ours.params, ref.params)
  assert int(ours.step) == 5 and memory_kinds(ours.opt_state) == {'pinned_host'}


def _train(tx, params, seed, steps, nan_at=()):
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  for i in range(steps):
    grads = random_grads(params, i, seed)
    if i in nan_at:
      grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    params, state = step(params, state, grads)
  return params, state


def test_multi_transform_equals_optax(seed):
  params = random_tree(seed)
  labels = {k: 'sgd' if k in ('b', 'scale') else 'adamw' for k in params}
  make = lambda adamw: optax.multi_transform(
      {'adamw': adamw, 'sgd': optax.sgd(LR, momentum=0.9)}, labels)
  ours, _ = _train(make(dos_jax.adamw(LR, offload=OFFLOAD)), params, seed, 5)
  ref, _ = _train(make(optax.adamw(LR)), params, seed, 5)
  assert_close(ours, ref)


@jax.jit
def _welford(acc, grads, n):
  return jax.tree.map(lambda a, g: a + (g - a) / (n + 1), acc, grads)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_multi_steps_accumulates_like_optax(dtype, seed):
  """k=3 MultiSteps: fp32 equals optax; bf16 (where optax's own math is bf16) equals
  dos_jax.adamw fed the mean of each k gradients."""
  params = random_tree(seed, dtype)
  ours, state = _train(optax.MultiSteps(dos_jax.adamw(LR, offload=OFFLOAD), 3), params,
                       seed, 9)
  assert int(state.gradient_step) == 3
  if dtype == jnp.float32:
    ref, _ = _train(optax.MultiSteps(optax.adamw(LR), 3), params, seed, 9)
    assert_close(ours, ref)
    return
  tx = dos_jax.adamw(LR, offload=OFFLOAD)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  p, s = params, tx.init(params)
  for k in range(3):
    grads = [random_grads(params, 3 * k + i, seed) for i in range(3)]
    # MultiSteps' running mean (Welford, in its fp32 accumulator), cast to the grads'.
    # As MultiSteps computes it: jitted, divided by its int32 step count (an eager
    # division by a constant may round otherwise, and a gradient near zero then turns
    # into a visibly different AdamW step).
    acc = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), grads[0])
    for n, g in enumerate(grads):
      acc = _welford(acc, g, jnp.int32(n))
    p, s = step(p, s, jax.tree.map(lambda a: a.astype(dtype), acc))
  assert_close(ours, p, rtol=0, atol=0)


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=['cpu-program', 'gpu-program'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_apply_if_finite_skips_a_nan_step_and_keeps_the_state(dtype, platform, seed):
  params = random_tree(seed, dtype)
  offload = dos_jax.Offload(subgroup_size=97, policy=dos_jax.Stride(2))
  implementation = dos_jax.Implementation(program=platform)
  make = lambda: optax.apply_if_finite(
      dos_jax.adamw(LR, offload=offload, implementation=implementation), 5)
  tx = make()
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  p, state = step(params, state, random_grads(params, 0, seed))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), random_grads(p, 1, seed))
  p2, state2 = step(p, state, bad)
  for a, b in zip(jax.tree.leaves((p, state.inner_state)),
                  jax.tree.leaves((p2, state2.inner_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(state2.notfinite_count) == 1 and int(state2.total_notfinite) == 1
  assert memory_kinds(state2) == {'pinned_host'}
  # Training on with the NaN step skipped equals training without it.
  # (Another program, so fp32 may differ in the last bit, and a bf16 cast of it by one
  # bf16 ulp, or half a bf16 ulp of one step where a bf16 update rounds.)
  skipped, _ = _train(make(), params, seed, 5, nan_at=(1,))
  tx_plain = dos_jax.adamw(LR, offload=offload, implementation=implementation)
  plain = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx_plain.update(g, s, p)))
  q, s = params, tx_plain.init(params)
  for i in (0, 2, 3, 4):
    q, s = plain(q, s, random_grads(params, i, seed))
  tol = (dict(rtol=1e-6, atol=1e-7) if dtype == jnp.float32
         else dict(rtol=2**-7, atol=4 * LR * 2**-8))
  assert_close(skipped, q, **tol)
  if dtype == jnp.float32:
    ref, _ = _train(optax.apply_if_finite(optax.adamw(LR), 5), params, seed, 5, nan_at=(1,))
    assert_close(skipped, ref)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_orbax_saves_and_restores_the_state_into_pinned_host(tmp_path, dtype, seed):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  params = random_tree(seed, dtype)
  tx = dos_jax.adamw(LR, offload=OFFLOAD)
  params, state = _train(tx, params, seed, 3)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / 'state', state)
  ckpt.wait_until_finished()
  target = dos_jax.abstract_state(tx, params)
  assert memory_kinds(target) == {'pinned_host'}
  restored = ckpt.restore(tmp_path / 'state', target)
  ckpt.close()
  assert memory_kinds(restored) == {'pinned_host'}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  g = random_grads(params, 3, seed)
  assert_close(step(params, restored, g), step(params, state, g), rtol=0, atol=0)


def test_optax_tree_utils_find_the_count_and_map_params(seed):
  params = random_tree(seed, jnp.bfloat16)
  tx = dos_jax.chain(optax.clip_by_global_norm(1.0), dos_jax.adamw(LR, offload=OFFLOAD))
  params, state = _train(tx, params, seed, 4)
  assert int(optax.tree_utils.tree_get(state, 'count')) == 4
  assert int(optax.tree_utils.tree_get(optax.tree_utils.tree_set(state, count=7), 'count')) == 7
  # The packed state holds no params-shaped tree: f is not applied, nothing raises.
  mapped = optax.tree_utils.tree_map_params(tx, lambda p: p * 0, state)
  for a, b in zip(jax.tree.leaves(mapped), jax.tree.leaves(state), strict=True):
    assert a is b
  flagged = optax.tree_utils.tree_map_params(tx, lambda p: p, state,
                                             transform_non_params=lambda _: 'other')
  assert flagged[1] == 'other'


def test_flax_serialization_round_trips_and_places_like_the_target(seed):
  from flax import serialization  # pylint: disable=import-outside-toplevel
  params = random_tree(seed, jnp.bfloat16)
  tx = dos_jax.adamw(LR, offload=OFFLOAD)
  params, state = _train(tx, params, seed, 3)
  data = serialization.to_bytes(state)
  restored = serialization.from_bytes(tx.init(params), data)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.memory_kind == b.sharding.memory_kind
  assert memory_kinds(restored) == {'pinned_host'}
