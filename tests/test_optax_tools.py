"""What optax users do with an optimizer besides stepping it: a jitted step that compiles
once, and optax's tree utilities reading the moments. Each against optax itself, on
fresh random inputs.

Tolerances: the moments are optax.scale_by_adam's math on the same gradients, fused
differently: rtol 1e-5 / atol 1e-7 in fp32. A bf16 first moment is rounded at every
step, and where its terms cancel the roundings of the larger terms show: within
2**-8 of the largest moment (bf16's half ulp at 1), rtol 2**-7.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import test_utils as optax_test_utils  # optax's own compile log

import dos_jax
from dos_jax import validate
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

LR = 1e-2
POLICIES = {
    'all_host': dos_jax.AllHost(),
    'all_device': dos_jax.AllDevice(),
    'stride2': dos_jax.Stride(2),
    'device_fraction': dos_jax.DeviceFraction(0.4),
}


def _step_fn(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', list(POLICIES), ids=list(POLICIES))
def test_jitted_step_compiles_once_with_committed_params(policy, dtype, seed):
  tx = dos_jax.adamw(LR, offload=dos_jax.Offload(subgroup_size=64, policy=POLICIES[policy]))
  params = jax.device_put(random_tree(seed, dtype), jax.devices()[0])  # README's one line
  state = tx.init(params)
  step = _step_fn(tx)
  grads = [random_grads(params, i, seed) for i in range(3)]
  params, state = step(params, state, grads[0])
  with optax_test_utils.log_compilations() as logs:
    for g in grads[1:]:
      params, state = step(params, state, g)
  assert not logs, [log.getMessage() for log in logs]
  assert step._cache_size() == 1  # pylint: disable=protected-access


def test_uncommitted_params_warn_once_with_the_one_line_fix(monkeypatch, seed):
  monkeypatch.setattr(validate, '_uncommitted_warned', False)
  tx = dos_jax.adamw(LR, offload=dos_jax.Offload(subgroup_size=64))
  params = random_tree(seed)
  assert not any(x.committed for x in jax.tree.leaves(params))
  with pytest.warns(UserWarning, match=r'jax\.device_put\(params, jax\.devices\(\)\[0\]\)'):
    tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    tx.init(params)  # once per process
    monkeypatch.setattr(validate, '_uncommitted_warned', False)
    tx.init(jax.device_put(params, jax.devices()[0]))  # committed: nothing to say


def test_jax_commits_outputs_of_a_program_that_moves_memory_kinds():
  """Why the warning exists: if this fails, JAX stopped forcing committed outputs and
  `validate.warn_if_uncommitted` (and the README's one line) can go."""
  x = jnp.arange(4.0)
  assert not x.committed
  plain = jax.jit(lambda x: x + 1)(x)
  moved = jax.jit(lambda x: (x + 1, jax.device_put(x, jax.memory.Space.Host)))(x)
  assert not plain.committed
  assert moved[0].committed


@pytest.mark.parametrize('mu_dtype', [None, jnp.bfloat16], ids=['mu_fp32', 'mu_bf16'])
@pytest.mark.parametrize('policy', ['all_host', 'stride2', 'all_device'])
def test_tree_get_reads_the_moments_as_optax_computes_them(policy, mu_dtype, seed):
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  tx = dos_jax.adamw(LR, mu_dtype=mu_dtype,
                     offload=dos_jax.Offload(subgroup_size=29, policy=POLICIES[policy]))
  ref = optax.adamw(LR, mu_dtype=mu_dtype)
  state, ref_state = tx.init(params), ref.init(params)
  steps, seen = 3, {'mu': 0.0, 'nu': 0.0}  # the largest |moment| over the steps
  for i in range(steps):
    grads = random_grads(params, i, seed)
    _, state = tx.update(grads, state, params)
    _, ref_state = ref.update(grads, ref_state, params)
    for name in seen:
      seen[name] = max([seen[name]] + [float(jnp.max(jnp.abs(x.astype(jnp.float32))))
                                       for x in jax.tree.leaves(optax.tree.get(ref_state, name))])
  for name, dtype in (('mu', mu_dtype or jnp.float32), ('nu', jnp.float32)):
    view = optax.tree.get(state, name)
    assert view.dtype == dtype
    assert view.shape == (state.layout.num_subgroups, 29)
    got = dos_jax.geometry.layout.unpack(view, state.layout)
    want = optax.tree.get(ref_state, name)
    low = jnp.dtype(dtype).itemsize == 2
    largest = seen[name]
    # A 16-bit moment is rounded once per step, and XLA may contract its fp32 update
    # differently in the two programs, so each step may land one ulp (<= 2**-7 of the
    # magnitude) on the other side; an earlier difference is carried on, scaled by
    # b1 < 1. After `steps` steps: at most `steps` ulps of the largest moment seen.
    rtol, atol = (0.0, steps * 2.0 ** -7 * largest) if low else (1e-5, 1e-7)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert a.dtype == b.dtype
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=rtol, atol=atol)
  # The moments are views, not leaves: the pytree, tree_set and count are unchanged.
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(jax.tree.map(lambda x: x, state)))
  assert int(optax.tree.get(state, 'count')) == 3
  assert int(optax.tree.get(optax.tree.set(state, count=jnp.int32(9)), 'count')) == 9


def test_tree_get_sees_the_moments_inside_jit(seed):
  """Inside jit, `optax.tree.get(state, 'nu')` and `'mu'` read the moments after two
  steps: their norms are optax.adamw's (fp32, rtol 1e-5)."""
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  tx = dos_jax.adamw(LR, offload=dos_jax.Offload(subgroup_size=64, policy=dos_jax.Stride(2)))
  ref = optax.adamw(LR)
  state, ref_state = tx.init(params), ref.init(params)
  p, q = params, params
  for step in range(2):
    grads = random_grads(params, step, seed)
    updates, state = tx.update(grads, state, p)
    ref_updates, ref_state = ref.update(grads, ref_state, q)
    p, q = optax.apply_updates(p, updates), optax.apply_updates(q, ref_updates)
  for name in ('nu', 'mu'):
    norm = jax.jit(lambda s, n=name: optax.tree.norm(optax.tree.get(s, n)))(state)
    want = optax.tree.norm(optax.tree.get(ref_state, name))
    assert float(want) > 0
    np.testing.assert_allclose(float(norm), float(want), rtol=1e-5)
