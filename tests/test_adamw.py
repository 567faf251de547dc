"""dos_jax.adamw against optax.adamw: every policy, fp32 and bf16 params, masks, schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.geometry.partition import Tier

POLICIES = [
    dos_jax.AllHost(),
    dos_jax.AllDevice(),
    dos_jax.Stride(2),
    dos_jax.Stride(3),
    dos_jax.DeviceFraction(0.4),
]


def random_tree(seed: int, dtype=jnp.float32):
  """Mixed shapes, a scalar, sizes that are not multiples of the subgroup size."""
  rng = np.random.default_rng(seed)
  shapes = {'emb': (19, 7), 'w': (5, 3, 4), 'b': (13,), 'scale': (), 'head': (7, 11)}
  return {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}


def random_grads(params, step: int, seed: int):
  keys = jax.random.split(jax.random.key(seed * 1000 + step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([
      jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)
  ])


def decay_mask(params):
  return {k: k not in ('b', 'scale') for k in params}


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 50, 1e-3)


def make_pair(policy, subgroup_size=23, impl=dos_jax.UpdateImpl.KERNEL, platform=None):
  kwargs = dict(learning_rate=SCHEDULE, weight_decay=0.05, mask=decay_mask)
  offload = dos_jax.Offload(subgroup_size=subgroup_size, policy=policy)
  implementation = dos_jax.Implementation(program=platform, device=impl, host=impl)
  return (dos_jax.adamw(**kwargs, offload=offload, implementation=implementation),
          optax.adamw(**kwargs))


def jit_step(opt, grad_dtype=None):
  """One jitted training step: update, then optax.apply_updates (grads cast if asked)."""

  @jax.jit
  def step(p, s, g):
    if grad_dtype is not None:
      g = jax.tree.map(lambda x: x.astype(grad_dtype), g)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step


# 'gpu': the two-memory program (split tiers, host regions, Pallas in interpret mode),
# run on the CPU backend.
@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('policy', POLICIES, ids=lambda p: repr(p))
def test_fp32_matches_optax_over_50_steps(policy, platform, seed):
  ours, ref = make_pair(policy, platform=platform)
  # Committed, as the uncommitted-params warning asks (`validate.COMMIT_PARAMS`).
  params = ref_params = jax.device_put(random_tree(seed), jax.devices()[0])
  state, ref_state = ours.init(params), ref.init(params)
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(50):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('impl', list(dos_jax.UpdateImpl), ids=lambda i: i.value)
@pytest.mark.parametrize('policy', POLICIES, ids=lambda p: repr(p))
def test_bf16_params_equal_optax_on_fp32_master(policy, impl, platform, seed):
  """bf16 params == cast(optax.adamw on the fp32 master), with the same grads.

  Both paths are bit for bit with jit(optax.adamw) on flat data, but optax compiled over
  a multi-leaf tree contracts its final add into an FMA differently, so the two fp32
  masters may differ in the last bit: the XLA path runs optax's own ops on the rows and
  still differs at 30-66 of these 284 elements after 50 steps (seeded inputs showed it;
  drawn seeds hid it, as the gap rarely straddles a bf16 rounding boundary). Where it
  does, the casts differ by one bf16 ulp. Our params, updated with optax's bf16
  updates, track the cast of our own master (see `assert_params_track_master`).
  """
  ours, ref = make_pair(policy, impl=impl, platform=platform)
  master = random_tree(seed)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
  # The reference master starts from the same values the bf16 params hold.
  ref_master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  state, ref_state = ours.init(params), ref.init(ref_master)
  step, ref_step = jit_step(ours), jit_step(ref, grad_dtype=jnp.float32)
  for i in range(50):
    grads = random_grads(params, i, seed)  # bf16 grads, as a bf16 model produces
    params, state = step(params, state, grads)
    ref_master, ref_state = ref_step(ref_master, ref_state, grads)

  master_leaves = dos_jax.geometry.layout.unpack(jax.device_put(state.master, jax.devices()[0]),
                                        state.layout)
  assert_params_track_master(params, master_leaves, step_bound=4 * 3e-2)
  ours_leaves = [m.astype(jnp.bfloat16) for m in master_leaves]
  ref_cast = [np.asarray(b.astype(jnp.bfloat16)) for b in jax.tree.leaves(ref_master)]
  differ = [np.asarray(a) != b for a, b in zip(ours_leaves, ref_cast)]
  mismatches, total = sum(int(d.sum()) for d in differ), sum(a.size for a in ours_leaves)
  for m, b in zip(master_leaves, jax.tree.leaves(ref_master)):
    np.testing.assert_allclose(np.asarray(m), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert mismatches <= max(1, total // 100), f'{mismatches}/{total} bf16 params differ'
  for a, b, d in zip(ours_leaves, ref_cast, differ):
    gap = np.abs(np.asarray(a, np.float32)[d] - b.astype(np.float32)[d])
    ulp = np.spacing(np.abs(b.astype(np.float32)[d])) * 2.0**16  # one bf16 ulp
    assert np.all(gap <= ulp), (gap, ulp)


def assert_params_track_master(params, master_leaves, step_bound: float):
  """bf16 params updated with bf16 updates (optax's dtype for bf16 params and grads) are
  the cast of the fp32 master except where a value changed by a large factor or crossed
  zero in one step: there `p + bf16(new - p)` rounds, by at most half a bf16 ulp of the
  step's change (< `step_bound`). Such elements must be rare (<= 5%: their share grows
  with the share of values near zero, e.g. zero-initialised biases)."""
  leaves = jax.tree.leaves(params)
  gaps = [np.abs(np.asarray(p, np.float32) - np.asarray(m.astype(jnp.bfloat16), np.float32))
          for p, m in zip(leaves, master_leaves)]
  total = sum(g.size for g in gaps)
  mismatches = sum(int((g > 0).sum()) for g in gaps)
  assert mismatches <= max(1, total // 20), f'{mismatches}/{total} params off the master'
  worst = max(float(g.max()) for g in gaps)
  assert worst <= step_bound * 2.0**-8, (worst, step_bound)


def test_fp32_params_keep_no_master(seed):
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16))
  state = opt.init(random_tree(seed))
  assert state.master is None
  bf16_state = opt.init(random_tree(seed, jnp.bfloat16))
  assert bf16_state.master is not None and bf16_state.master.dtype == jnp.float32


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2)], ids=repr)
def test_state_lives_in_pinned_host(policy, platform, seed):
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16, policy=policy),
                      implementation=dos_jax.Implementation(program=platform))
  params = random_tree(seed, jnp.bfloat16)
  state = opt.init(params)
  step = jax.jit(opt.update)
  _, state = step(random_grads(params, 0, seed), state, params)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim == 3 and x.size}
  assert kinds == {'pinned_host'}
  # The host and streamed tiers are pinned_host; the resident tier is device memory.
  # The one-memory program's empty tiers are arrays of no row, in their memory too;
  # stored per subgroup (the two-memory program), an empty tier has no array.
  for tier, arrays in state.tiers.items():
    want = 'device' if tier is Tier.RESIDENT else 'pinned_host'
    held = bool(state.partition.ids(tier)) or not state.partition.two_memories
    assert {x.sharding.memory_kind for x in arrays} == ({want} if held else set()), tier
  # Step counts are scalars and stay in device memory.
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim == 0} == {'device'}


def test_all_device_state_lives_in_device_memory(seed):
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16, policy=dos_jax.AllDevice()))
  state = opt.init(random_tree(seed))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.size} == {'device'}
  assert state.partition.resident == tuple(range(state.layout.num_subgroups))


def test_mu_dtype_bf16_halves_first_moment(seed):
  opt = dos_jax.adamw(1e-3, mu_dtype=jnp.bfloat16, offload=dos_jax.Offload(subgroup_size=16))
  state = opt.init(random_tree(seed))
  assert optax.tree.get(state.inner, 'mu').dtype == jnp.bfloat16
  assert optax.tree.get(state.inner, 'nu').dtype == jnp.float32
  # Stored as one fp32 array (nu) and one bf16 array (mu).
  assert sorted(x.dtype.name for x in state.host) == ['bfloat16', 'float32']


def test_no_recompilation_across_steps(seed):
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16, policy=dos_jax.Stride(2)))
  # Committed, like a model's params after its first step (an uncommitted array is a
  # different jit cache key).
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  params, state = step(params, state, random_grads(params, 0, seed))
  with jax.log_compiles():
    compiles_before = step._cache_size()  # pylint: disable=protected-access
    for i in range(1, 11):
      params, state = step(params, state, random_grads(params, i, seed))
  assert step._cache_size() == compiles_before == 1  # pylint: disable=protected-access


def test_plan_override_compiles_once_per_plan(seed):
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=16, policy=dos_jax.AllHost()))
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  state = opt.init(params)
  spec = state.layout.spec()

  @jax.jit
  def step(p, s, g, plan):
    u, s = opt.update(g, s, p, plan=plan)
    return optax.apply_updates(p, u), s

  step = jax.jit(step.__wrapped__, static_argnames='plan')
  plans = [dos_jax.Stride(2).plan(spec), dos_jax.AllHost().plan(spec)]
  for i in range(6):
    params, state = step(params, state, random_grads(params, i, seed), plan=plans[i % 2])
  assert step._cache_size() == 2  # pylint: disable=protected-access


def test_compile_time_does_not_grow_with_subgroups():
  """The subgroup loops are fori_loops: the program size does not depend on G."""
  params = {'w': jnp.ones((4096,))}

  def hlo_size(subgroup_size):
    opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=subgroup_size,
                                                      policy=dos_jax.Stride(2)))
    state = opt.init(params)
    return len(jax.jit(opt.update).lower(params, state, params).as_text())

  few, many = hlo_size(1024), hlo_size(32)  # 4 vs 128 subgroups
  assert many < 1.2 * few, (few, many)


@pytest.mark.parametrize('policy', POLICIES, ids=repr)
def test_donated_update_makes_no_copy_of_the_state(policy):
  params = {'w': jnp.ones((1 << 16,), jnp.bfloat16)}
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=1 << 13, policy=policy))
  state = opt.init(params)
  compiled = jax.jit(opt.update, donate_argnums=1).lower(params, state, params).compile()
  stats = compiled.memory_analysis()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  # Temporaries: packed gradient rows, new parameter rows, the host rows' gradients and
  # a few subgroups' state in flight. A copy of the state would not fit under this.
  assert stats.temp_size_in_bytes < state_bytes, (stats.temp_size_in_bytes, state_bytes)


def test_schedule_and_inject_hyperparams(seed):
  params = random_tree(seed)
  opt = optax.inject_hyperparams(dos_jax.adamw)(
      learning_rate=1e-2, offload=dos_jax.Offload(subgroup_size=16))
  ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
  state, ref_state = opt.init(params), ref.init(params)
  grads = random_grads(params, 0, seed)
  u, _ = jax.jit(opt.update)(grads, state, params)
  ru, _ = jax.jit(ref.update)(grads, ref_state, params)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(ru)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_multisteps_accumulates_then_updates(seed):
  params = random_tree(seed)
  opt = optax.MultiSteps(dos_jax.adamw(1e-2, offload=dos_jax.Offload(subgroup_size=16)), 3)
  ref = optax.MultiSteps(optax.adamw(1e-2), 3)
  state, ref_state = opt.init(params), ref.init(params)
  p, rp = params, params
  update, ref_update = jax.jit(opt.update), jax.jit(ref.update)
  for i in range(6):
    grads = random_grads(params, i, seed)
    u, state = update(grads, state, p)
    ru, ref_state = ref_update(grads, ref_state, rp)
    p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_inside_optax_chain_with_clipping(seed):
  params = random_tree(seed)
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    dos_jax.adamw(1e-2, offload=dos_jax.Offload(subgroup_size=16)))
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  grads = jax.tree.map(lambda g: 10 * g, random_grads(params, 0, seed))
  u, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  ru, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(ru)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_plan_changes_migrate_rows_between_tiers_and_keep_the_math(seed):
  """The two-memory program stores each tier apart: a plan with another split moves
  the rows (host <-> streamed <-> resident) between the steps (`dos_jax.migrate`), and
  the math is optax's. A jitted step handed a state laid out for another plan says so."""
  ours, ref = make_pair(dos_jax.AllHost(), platform='gpu')
  params = ref_params = random_tree(seed)
  state, ref_state = ours.init(params), ref.init(params)
  spec = state.layout.spec()
  plans = [dos_jax.Stride(2).plan(spec), dos_jax.AllDevice().plan(spec),
           dos_jax.DeviceFraction(0.4).plan(spec), dos_jax.AllHost().plan(spec)]

  def step(p, s, g, plan):
    u, s = ours.update(g, s, p, plan=plan)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, static_argnames='plan')
  ref_step = jit_step(ref)
  with pytest.raises(ValueError, match=r'dos_jax.migrate\(opt_state, plan\)'):
    step(params, state, random_grads(params, 0, seed), plan=plans[0])
  for i in range(8):
    plan = plans[i % len(plans)]
    grads = random_grads(params, i, seed)
    state = dos_jax.migrate(state, plan)
    params, state = step(params, state, grads, plan=plan)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
    assert state.partition.streamed == tuple(sorted(plan.streamed))
    assert state.partition.resident == tuple(sorted(plan.resident))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
