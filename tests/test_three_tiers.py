"""Three placements per subgroup (resident / streamed / host): policies, the transform
against optax for every mix, migration between tiers, compiles, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax import migrate as migrate_lib
from dos_jax import transform
from dos_jax.partition import Tier
from dos_jax.policies import SubgroupSpec
from tests.test_adamw import assert_params_track_master
from tests.test_adamw import jit_step
from tests.test_adamw import make_pair
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

MIXES = [
    dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)),
    dos_jax.Resident(2, then=dos_jax.DeviceFraction(0.5, buffers=1)),
    dos_jax.ResidentFraction(0.5),  # resident + host, nothing streamed (Twin-Flow)
    dos_jax.Resident(1, then=dos_jax.Stride(1)),  # resident + streamed, nothing on host
    dos_jax.Resident(0, then=dos_jax.Stride(3)),
]


def spec(n):
  return SubgroupSpec(num_subgroups=n, subgroup_size=10, num_elements=10 * n - 3)


def test_resident_policies_place_the_first_subgroups_and_delegate_the_rest():
  plan = dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)).plan(spec(10))
  assert plan.resident == (0, 1, 2)
  assert plan.device == (3, 5, 7, 9) and plan.host == (4, 6, 8)
  assert dos_jax.Resident(10).plan(spec(10)) == dos_jax.AllDevice().plan(spec(10))
  assert dos_jax.Resident(0).plan(spec(4)) == dos_jax.AllHost().plan(spec(4))
  assert dos_jax.Resident(3, then=dos_jax.Stride(1, buffers=3)).plan(spec(5)).buffers == 3
  assert dos_jax.AllDevice().plan(spec(3)).all_resident
  assert '3/10 subgroups resident' in plan.describe()


@pytest.mark.parametrize('bad, error', [
    (lambda: dos_jax.Resident(-1), ValueError),
    (lambda: dos_jax.Resident(True), ValueError),
    (lambda: dos_jax.ResidentFraction(1.5), ValueError),
    (lambda: dos_jax.ResidentFraction(0.3, then='stride'), TypeError),
    (lambda: dos_jax.ResidentFraction(0.3, then=dos_jax.Stride), TypeError),
    (lambda: dos_jax.Resident(11).plan(spec(10)), ValueError),
    (lambda: dos_jax.Resident(1, then=dos_jax.AllDevice()).plan(spec(3)), ValueError),
    (lambda: dos_jax.Plan(device=(0,), host=(1,), resident=(1,)), ValueError),
    (lambda: dos_jax.Plan(device=(0,), host=(1,), resident=True), TypeError),
])
def test_bad_policies_and_plans_are_refused(bad, error):
  with pytest.raises(error):
    bad()


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('policy', MIXES, ids=repr)
def test_every_mix_matches_optax_fp32(policy, platform):
  seed = np.random.randint(1 << 30)
  ours, ref = make_pair(policy, platform=platform)
  params = ref_params = random_tree(seed)
  state, ref_state = ours.init(params), ref.init(params)
  if platform == 'gpu':  # the split program stores each placement as its own tier
    plan = policy.plan(state.layout.spec())
    assert state.partition.resident == plan.resident
    assert state.partition.streamed == tuple(sorted(plan.device))
    assert {x.sharding.memory_kind for x in state.resident} == {'device'}
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(6):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('policy', MIXES[:2], ids=repr)
def test_every_mix_matches_optax_bf16_on_the_fp32_master(policy):
  """As test_adamw's bf16 test: bf16 params track the cast of our fp32 master, which
  matches optax's fp32 master to the last bit or so (XLA may contract differently)."""
  seed = np.random.randint(1 << 30)
  ours, ref = make_pair(policy, impl=dos_jax.UpdateImpl.XLA, platform='gpu')
  master = random_tree(seed)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
  ref_master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  state, ref_state = ours.init(params), ref.init(ref_master)
  step, ref_step = jit_step(ours), jit_step(ref, grad_dtype=jnp.float32)
  for i in range(10):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_master, ref_state = ref_step(ref_master, ref_state, grads)
  master_leaves = dos_jax.layout.unpack(jax.device_put(state.master, jax.devices()[0]),
                                        state.layout)
  assert_params_track_master(params, master_leaves, step_bound=4 * 3e-2)
  for m, b in zip(master_leaves, jax.tree.leaves(ref_master)):
    np.testing.assert_allclose(np.asarray(m), np.asarray(b), rtol=1e-6, atol=1e-7)


def _plans(layout_spec):
  return [p.plan(layout_spec) for p in (
      dos_jax.AllHost(), dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)),
      dos_jax.AllDevice(), dos_jax.Resident(1, then=dos_jax.Stride(1)),
      dos_jax.ResidentFraction(0.6), dos_jax.Stride(3))]


def test_migration_is_exact_and_lands_in_the_right_memory():
  """Moving rows between tiers copies them bit for bit: the whole state read back in
  subgroup order is unchanged, and each tier is in its memory."""
  ours, _ = make_pair(dos_jax.AllHost(), platform='gpu')
  state = ours.init(random_tree(np.random.randint(1 << 30)))
  # Distinct values in every row (the moments start as zeros).
  rows = tuple(jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), x.dtype)
               for x in state.rows())
  tiers = dos_jax.partition.split_tiers(rows, state.partition)
  host = lambda t: jax.device_put(tiers[t], dos_jax.paths.HOST)
  state = transform.OffloadedState(
      host=host(Tier.HOST), streamed=host(Tier.STREAMED), resident=tiers[Tier.RESIDENT],
      scalars=state.scalars, layout=state.layout, slots=state.slots, partition=state.partition)
  migrate = jax.jit(lambda s, part: migrate_lib.migrate(s, part, True),
                    static_argnums=1)
  for plan in _plans(state.layout.spec()):
    wanted = dos_jax.partition.for_plan(plan, split=True)
    state = migrate(state, wanted)
    assert state.partition == wanted
    for tier, arrays in state.tiers.items():
      assert all(x.shape[0] == len(wanted.ids(tier)) for x in arrays)
      want = 'device' if tier is Tier.RESIDENT else 'pinned_host'
      assert {x.sharding.memory_kind for x in arrays} == {want}, tier
    for a, b in zip(state.rows(), rows):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plan_changes_with_three_tiers_keep_optax_math_and_compile_once_per_plan():
  seed = np.random.randint(1 << 30)
  ours, ref = make_pair(dos_jax.AllHost(), platform='gpu')
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  ref_params = params
  state, ref_state = ours.init(params), ref.init(params)
  plans = _plans(state.layout.spec())

  def step(p, s, g, plan):
    u, s = ours.update(g, s, p, plan=plan)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, static_argnames='plan')
  ref_step = jit_step(ref)
  # Each plan twice in a row: the first step migrates (its input partition is the
  # previous plan's), the second runs the plan on its own tiers. A program is keyed by
  # (input partition, plan): the second cycle meets the last->first transition once
  # more, the third cycle compiles nothing new.
  for i in range(6 * len(plans)):
    plan = plans[(i // 2) % len(plans)]
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads, plan=plan)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
    assert state.partition.resident == plan.resident
    if i == 4 * len(plans) - 1:
      compiled = step._cache_size()  # pylint: disable=protected-access
  assert step._cache_size() == compiled <= 2 * len(plans) + 1  # pylint: disable=protected-access
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_migration_temporaries_stay_below_one_copy_and_unchanged_tiers_alias():
  """A step that migrates builds no merged copy of the state: its temporaries stay
  below the state's size, and under donation a tier whose subgroups do not change
  keeps its buffer. (The changed tiers' new arrays are outputs beside the donated
  inputs: an XLA array cannot grow or shrink in place.)"""
  params = {'w': jnp.ones((1 << 16,), jnp.float32)}
  offload = dos_jax.Offload(subgroup_size=1 << 12, policy=dos_jax.Stride(2), platform='gpu',
                            device_impl=dos_jax.UpdateImpl.XLA, host_impl=dos_jax.UpdateImpl.XLA)
  opt = dos_jax.adamw(1e-3, offload=offload)
  state = opt.init(params)
  spec_ = state.layout.spec()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

  def stats(plan):
    wanted = dos_jax.partition.for_plan(plan, split=True)
    migrate = jax.jit(lambda s: migrate_lib.migrate(s, wanted, True),
                      donate_argnums=0)
    return migrate.lower(state).compile().memory_analysis()

  for policy in (dos_jax.Stride(4), dos_jax.ResidentFraction(0.25, then=dos_jax.Stride(2)),
                 dos_jax.AllDevice()):
    got = stats(policy.plan(spec_))
    assert got.temp_size_in_bytes < state_bytes, (policy, got.temp_size_in_bytes, state_bytes)
  same = stats(dos_jax.Stride(2).plan(spec_))
  assert same.temp_size_in_bytes == 0 and same.alias_size_in_bytes >= state_bytes - 64


def test_auto_reports_migration_in_the_step_record():
  from dos_jax.planner import costmodel  # pylint: disable=import-outside-toplevel
  profile = costmodel.H100_PCIE_GEN5_NODE
  s = SubgroupSpec(20, 10**8, 20 * 10**8, 12, 2, 2)
  policy = dos_jax.Auto(profile, budget_bytes=8 * 1.2e9, tolerance=0.1, patience=1, warmup=0)
  first = policy.plan(s)
  assert policy.record(0).migrated_subgroups == 0
  # Far slower than predicted: the profile is corrected and the plan changes.
  new = policy.observe(first, 50 * policy.prediction.update_seconds)
  assert new != first
  record = policy.record(1)
  moved = costmodel.migration(policy.profile, s, first, new)
  assert record.migrated_subgroups == moved.subgroups > 0
  assert record.migration_s == moved.seconds > 0
  assert policy.record(2).migrated_subgroups == 0  # reported once
