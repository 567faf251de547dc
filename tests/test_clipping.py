"""Global-norm clipping applied where each subgroup is updated, against optax's clip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax

from tests.test_adamw import random_grads
from tests.test_adamw import random_tree


def _run(opt, params, grads_seq):
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  for grads in grads_seq:
    params, state = step(params, state, grads)
  return params


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2),
                                    dos_jax.AllDevice()], ids=repr)
def test_clip_as_grad_scale_matches_optax_chain(policy, platform, seed):
  params = random_tree(seed)
  # Norms around the threshold: some steps clip, some do not.
  grads_seq = [jax.tree.map(lambda g, s=s: s * g, random_grads(params, i, seed))
               for i, s in enumerate([0.1, 3.0, 10.0, 0.2, 5.0, 1.0])]
  offload = dos_jax.Offload(subgroup_size=23, policy=policy)
  ours = dos_jax.chain(dos_jax.clip_by_global_norm(2.0), dos_jax.adamw(
      3e-2, weight_decay=0.1, offload=offload,
      implementation=dos_jax.Implementation(program=platform)))
  ref = optax.chain(optax.clip_by_global_norm(2.0), optax.adamw(3e-2, weight_decay=0.1))
  for a, b in zip(jax.tree.leaves(_run(ours, params, grads_seq)),
                  jax.tree.leaves(_run(ref, params, grads_seq))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_clip_with_element_wise_members_matches_optax_chain(seed):
  params = random_tree(seed)
  grads_seq = [jax.tree.map(lambda g: 10 * g, random_grads(params, i, seed)) for i in range(4)]
  members = lambda: (optax.scale_by_adam(), optax.scale_by_learning_rate(1e-2))
  ours = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), *members(),
                       offload=dos_jax.Offload(subgroup_size=16),
                       implementation=dos_jax.Implementation(program='gpu'))
  ref = optax.chain(optax.clip_by_global_norm(1.0), *members())
  for a, b in zip(jax.tree.leaves(_run(ours, params, grads_seq)),
                  jax.tree.leaves(_run(ref, params, grads_seq))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_clip_alone_is_optax_clip(seed):
  params = random_tree(seed)
  grads = jax.tree.map(lambda g: 7 * g, random_grads(params, 0, seed))
  ours, _ = dos_jax.clip_by_global_norm(1.5).update(grads, optax.EmptyState())
  ref, _ = optax.clip_by_global_norm(1.5).update(grads, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)


def test_the_clip_reaches_the_update_as_a_scale_not_a_scaled_tree():
  """The offloaded update receives the raw gradients and the clip factor."""
  params = {'w': jnp.ones((40,))}
  seen = {}
  body = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16))
  original = body.update

  def spy(updates, state, params=None, **extra):
    seen.update(extra, grads=updates)
    return original(updates, state, params, **extra)

  body = dos_jax.clipping.mark_offloaded(optax.GradientTransformationExtraArgs(body.init, spy))
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), body)
  grads = {'w': jnp.full((40,), 2.0)}
  opt.update(grads, opt.init(params), params)
  np.testing.assert_array_equal(seen['grads']['w'], grads['w'])
  np.testing.assert_allclose(seen['grad_scale'], 1.0 / np.sqrt(40 * 4.0), rtol=1e-6)
