"""The step is a function of (updates, state, params): what the state was built for (the
mesh, the params' shardings, the program) travels with the state, so any transform
built alike keeps a sharded state split over 'data', step after step, with the numbers
of the transform that made it.

On a 2-device `data` mesh: under `optax.inject_hyperparams` (a new inner transform at
every update), with a fresh transform given a state another one made (as after a
restart), and under `optax.MultiSteps`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dos_jax
from tests.test_adamw import random_grads

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')

LR = 1e-2
SEED = 30  # the number: fixed, so a failure reproduces
STEPS = 4
ROWS = P(None, None, 'data')
PLATFORMS = pytest.mark.parametrize('platform', ['cpu', 'gpu'],
                                    ids=['cpu-program', 'gpu-program'])


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), ('data',))


def _shardings(mesh):
  return {'w': NamedSharding(mesh, P('data')), 'v': NamedSharding(mesh, P(None, 'data')),
          'b': NamedSharding(mesh, P())}


def _params(mesh):
  rng = np.random.default_rng(SEED)
  shapes = {'w': (8, 6), 'v': (6, 10), 'b': (6,)}
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  return jax.device_put(params, _shardings(mesh))


def _options(platform):
  """The `offload` and `implementation` arguments of every transform here."""
  return dict(offload=dos_jax.Offload(subgroup_size=16, policy=dos_jax.Stride(2)),
              implementation=dos_jax.Implementation(program=platform))


def _offloaded(state):
  """The `OffloadedState` inside an optax state (wrappers' states included)."""
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  found = [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]
  assert len(found) == 1, found
  return found[0]


def assert_split_over_data(state, when):
  rows = [x for x in jax.tree.leaves(_offloaded(state)) if x.ndim == 3 and x.size]
  assert rows, when
  for x in rows:
    assert x.sharding.spec == ROWS, (when, x.sharding)
    assert x.sharding.memory_kind == 'pinned_host', (when, x.sharding)


def _update_step(tx):
  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return u, optax.apply_updates(p, u), s

  return step


def _train(init_tx, step_tx, params, grads):
  """`init_tx` makes the state, `step_tx` steps it; every step's updates, checking the
  state after init and after each step."""
  state = init_tx.init(params)
  assert_split_over_data(state, 'init')
  step, p, updates, compiled = _update_step(step_tx), params, [], []
  for i, g in enumerate(grads):
    u, p, state = step(p, state, g)
    assert_split_over_data(state, f'step {i}')
    updates.append(u)
    compiled.append(step._cache_size())  # pylint: disable=protected-access
  # No recompilation once the state has been through a step: the static data it
  # carries is the same object every step. (The second step may compile again: optax
  # wrappers init their own counters uncommitted, and the first step commits them.)
  assert compiled[1:] == [compiled[1]] * (len(grads) - 1), compiled
  return updates, state


def _grads(params, mesh, steps=STEPS):
  return [jax.device_put(random_grads(params, i, SEED), _shardings(mesh)) for i in range(steps)]


def assert_same_updates(got, want):
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    for key in b:
      np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]),
                                    err_msg=f'step {i}, {key}')


@PLATFORMS
def test_inject_hyperparams_keeps_the_state_split(platform):
  mesh = _mesh()
  params, options = _params(mesh), _options(platform)
  grads = _grads(params, mesh)
  injected = optax.inject_hyperparams(dos_jax.adamw)(learning_rate=LR, **options)
  # The plain transform given what inject_hyperparams gives it: every numeric
  # hyperparameter (the defaults too) as an fp32 array.
  hyper = dict(learning_rate=LR, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4)
  plain = dos_jax.adamw(**{k: jnp.asarray(v, jnp.float32) for k, v in hyper.items()},
                        **options)
  want, _ = _train(plain, plain, params, grads)
  got, state = _train(injected, injected, params, grads)
  assert_same_updates(got, want)
  assert float(state.hyperparams['learning_rate']) == pytest.approx(LR)


@PLATFORMS
def test_a_fresh_transform_steps_a_state_another_one_made(platform):
  """As after a restart: the transform that steps the state never ran `init`."""
  mesh = _mesh()
  params, options = _params(mesh), _options(platform)
  grads = _grads(params, mesh)
  made_by = dos_jax.adamw(LR, **options)
  want, _ = _train(made_by, made_by, params, grads)
  got, _ = _train(made_by, dos_jax.adamw(LR, **options), params, grads)
  assert_same_updates(got, want)


def test_multi_steps_keeps_the_state_split():
  """k=2: every second step emits the inner update of the two gradients' mean (as
  MultiSteps averages them), the others zeros; the state stays split throughout."""
  mesh = _mesh()
  params, options = _params(mesh), _options(None)
  grads = _grads(params, mesh, steps=2 * STEPS)
  got, _ = _train(optax.MultiSteps(dos_jax.adamw(LR, **options), every_k_schedule=2),
                  optax.MultiSteps(dos_jax.adamw(LR, **options), every_k_schedule=2),
                  params, grads)

  @jax.jit
  def mean(g0, g1):  # MultiSteps' running mean (Welford), with its int32 counts
    first = jax.tree.map(lambda g: 0 + (g - 0) / (jnp.int32(0) + 1), g0)
    return jax.tree.map(lambda g, acc: acc + (g - acc) / (jnp.int32(1) + 1), g1, first)

  plain = dos_jax.adamw(LR, **options)
  want, _ = _train(plain, plain, params,
                   [mean(grads[i], grads[i + 1]) for i in range(0, len(grads), 2)])
  zeros = jax.tree.map(jnp.zeros_like, want[0])
  assert_same_updates(got, [u for w in want for u in (zeros, w)])


def test_a_state_restored_by_orbax_steps_like_the_saved_one(tmp_path):
  """A restart: the state is saved, restored into a target another transform describes
  (`dos_jax.abstract_state`), and stepped by a third; it stays split, step for step as
  the saved state goes on under the transform that made it."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mesh = _mesh()
  params, options = _params(mesh), _options(None)
  grads = _grads(params, mesh, steps=2 * 2)
  tx = dos_jax.adamw(LR, **options)
  state, step, p = tx.init(params), _update_step(tx), params
  for g in grads[:2]:
    _, p, state = step(p, state, g)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / 'state', state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / 'state',
                          dos_jax.abstract_state(dos_jax.adamw(LR, **options), p))
  ckpt.close()
  assert_split_over_data(restored, 'restored')
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  fresh_step, fresh_p, want, got = _update_step(dos_jax.adamw(LR, **options)), p, [], []
  for i, g in enumerate(grads[2:]):
    u, p, state = step(p, state, g)
    want.append(u)
    u, fresh_p, restored = fresh_step(fresh_p, restored, g)
    got.append(u)
    assert_split_over_data(restored, f'step {i} after the restore')
  assert_same_updates(got, want)
