"""dos_jax.chain against optax.chain, bad input, and layout-independent state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from tests.test_adamw import random_grads, random_tree

OFFLOAD = dos_jax.Offload(subgroup_size=29, policy=dos_jax.Stride(2))


def run(opt, params, steps, seed):
  state = opt.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *opt.update(g, s, p)))
  for i in range(steps):
    params, state = step(params, state, random_grads(params, i, seed))
  return params, state


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_chain_matches_optax_chain(seed):
  params = random_tree(seed)
  members = lambda: (optax.scale_by_adam(), optax.add_decayed_weights(0.1),
                     optax.scale_by_learning_rate(1e-3))
  ours, _ = run(dos_jax.chain(*members(), offload=OFFLOAD), params, 10, seed)
  ref, _ = run(optax.chain(*members()), params, 10, seed)
  assert_trees_close(ours, ref)


def test_chain_with_leading_global_clip_and_trace(seed):
  params = random_tree(seed)
  members = lambda: (optax.clip_by_global_norm(0.5), optax.trace(0.9),
                     optax.scale_by_learning_rate(1e-2))
  ours, state = run(dos_jax.chain(*members(), offload=OFFLOAD), params, 5, seed)
  ref, _ = run(optax.chain(*members()), params, 5, seed)
  assert_trees_close(ours, ref)
  assert any(x.sharding.memory_kind == 'pinned_host' for x in jax.tree.leaves(state))


@pytest.mark.parametrize('bad', [
    lambda: optax.add_decayed_weights(0.1, mask=lambda p: p),   # masked: per-leaf structure
    lambda: optax.chain(optax.scale_by_adam()),                # nested chain: opaque
])
def test_chain_rejects_non_elementwise_transform_at_init(bad, seed):
  opt = dos_jax.chain(optax.scale_by_adam(), bad(), offload=OFFLOAD)
  with pytest.raises(TypeError, match=r'transform #1 \((masked|chain)\)'):
    opt.init(random_tree(seed))


def test_global_clip_after_stateful_transform_is_rejected(seed):
  opt = dos_jax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(1.0), offload=OFFLOAD)
  with pytest.raises(TypeError, match='clip_by_global_norm'):
    opt.init(random_tree(seed))


def test_bad_input_names_the_culprit():
  with pytest.raises(ValueError, match='subgroup_size'):
    dos_jax.Offload(subgroup_size=0)
  with pytest.raises(ValueError, match='subgroup_size'):
    dos_jax.Offload(subgroup_size=-5)
  with pytest.raises(TypeError, match='policy'):
    dos_jax.Offload(policy='stride')
  with pytest.raises(ValueError, match='Stride.k'):
    dos_jax.Stride(0)
  with pytest.raises(ValueError, match='DeviceFraction.f'):
    dos_jax.DeviceFraction(1.5)
  opt = dos_jax.adamw(1e-3, offload=OFFLOAD)
  with pytest.raises(ValueError, match='empty'):
    opt.init({})
  with pytest.raises(TypeError, match=r"\['step'\].*int32"):
    opt.init({'w': jnp.ones(3), 'step': jnp.zeros((), jnp.int32)})
  with pytest.raises(TypeError, match='complex'):
    opt.init({'w': jnp.ones(3, jnp.complex64)})
  with pytest.raises(ValueError, match='mask'):
    dos_jax.adamw(1e-3, mask={'other': True}, offload=OFFLOAD).init({'w': jnp.ones(3)})


@pytest.mark.parametrize('new_offload', [
    dos_jax.Offload(subgroup_size=7, policy=dos_jax.AllHost()),
    dos_jax.Offload(subgroup_size=64, policy=dos_jax.AllDevice()),
])
def test_state_survives_a_change_of_subgroup_size_and_policy(new_offload, seed):
  """Training continued after a re-pack equals training continued without one."""
  params = random_tree(seed, jnp.bfloat16)
  opt = dos_jax.adamw(1e-2, offload=OFFLOAD)
  params, state = run(opt, params, 3, seed)
  portable = dos_jax.state_to_pytrees(state, params)
  other = dos_jax.adamw(1e-2, offload=new_offload)
  moved = dos_jax.state_from_pytrees(portable, params, other)
  assert moved.layout.subgroup_size != state.layout.subgroup_size

  def continue_with(o, s, p):
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *o.update(g, s, p)))
    for i in range(3, 6):
      p, s = step(p, s, random_grads(p, i, seed))
    return p

  np.testing.assert_equal(
      jax.tree.map(np.asarray, continue_with(other, moved, params)),
      jax.tree.map(np.asarray, continue_with(opt, state, params)))
