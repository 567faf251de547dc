"""Three placements per subgroup (resident / streamed / host): policies, the transform
against optax for every mix, migration between tiers, compiles, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax import migration as migration_lib
from dos_jax.step import transform
from dos_jax.geometry.partition import Tier
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
  assert plan.streamed == (3, 5, 7, 9) and plan.host == (4, 6, 8)
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
    (lambda: dos_jax.Plan(streamed=(0,), host=(1,), resident=(1,)), ValueError),
    (lambda: dos_jax.Plan(streamed=(0,), host=(1,), resident=True), TypeError),
])
def test_bad_policies_and_plans_are_refused(bad, error):
  with pytest.raises(error):
    bad()


@pytest.mark.parametrize('platform', ['cpu', 'gpu'])
@pytest.mark.parametrize('policy', MIXES, ids=repr)
def test_every_mix_matches_optax_fp32(policy, platform, seed):
  ours, ref = make_pair(policy, platform=platform)
  params = ref_params = random_tree(seed)
  state, ref_state = ours.init(params), ref.init(params)
  if platform == 'gpu':  # the split program stores each placement as its own tier
    plan = policy.plan(state.layout.spec())
    assert state.partition.resident == plan.resident
    assert state.partition.streamed == tuple(sorted(plan.streamed))
    # One block per subgroup: no resident subgroup, no resident array.
    assert {x.sharding.memory_kind for x in state.resident} == (
        {'device'} if plan.resident else set())
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(6):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('policy', MIXES[:2], ids=repr)
def test_every_mix_matches_optax_bf16_on_the_fp32_master(policy, seed):
  """As test_adamw's bf16 test: bf16 params track the cast of our fp32 master, which
  matches optax's fp32 master to the last bit or so (XLA may contract differently)."""
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
  master_leaves = dos_jax.geometry.layout.unpack(jax.device_put(state.master, jax.devices()[0]),
                                        state.layout)
  assert_params_track_master(params, master_leaves, step_bound=4 * 3e-2)
  for m, b in zip(master_leaves, jax.tree.leaves(ref_master)):
    np.testing.assert_allclose(np.asarray(m), np.asarray(b), rtol=1e-6, atol=1e-7)


def _plans(layout_spec):
  return [p.plan(layout_spec) for p in (
      dos_jax.AllHost(), dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)),
      dos_jax.AllDevice(), dos_jax.Resident(1, then=dos_jax.Stride(1)),
      dos_jax.ResidentFraction(0.6), dos_jax.Stride(3))]


def distinct_state(seed):
  """An AllHost state of the two-memory program whose every element differs (the
  moments start as zeros), and its rows in subgroup order."""
  ours, _ = make_pair(dos_jax.AllHost(), platform='gpu')
  state = ours.init(random_tree(seed))
  rng = np.random.default_rng(seed)
  rows = tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype)
               for x in state.rows())
  tiers = dos_jax.geometry.partition.split_tiers(rows, state.partition)
  host = lambda t: jax.device_put(tiers[t], dos_jax.memory_spaces.HOST)
  state = transform.OffloadedState(
      host=host(Tier.HOST), streamed=host(Tier.STREAMED), resident=tiers[Tier.RESIDENT],
      scalars=state.scalars, layout=state.layout, slots=state.slots, partition=state.partition)
  return state, rows


def test_migration_is_exact_and_lands_in_the_right_memory(seed):
  """Moving rows between tiers copies them bit for bit: the whole state read back in
  subgroup order is unchanged, each tier is in its memory, and a tier whose subgroups
  stay put is handed over as it is (the same arrays)."""
  state, rows = distinct_state(seed)
  for plan in _plans(state.layout.spec()):
    wanted = dos_jax.geometry.partition.for_plan(plan, two_memories=True)
    old, state = state, dos_jax.migrate(state, plan)
    assert state.partition == wanted
    for tier, arrays in state.tiers.items():
      blocks = wanted.blocks(tier)  # one block per subgroup, an array per dtype group
      groups = len(state.slots.groups)
      assert [x.shape[0] for x in arrays] == [len(ids) for ids in blocks for _ in range(groups)]
      want = 'device' if tier is Tier.RESIDENT else 'pinned_host'
      assert {x.sharding.memory_kind for x in arrays} == ({want} if blocks else set()), tier
      if blocks == old.partition.blocks(tier):
        assert all(a is b for a, b in zip(arrays, old.tier(tier)))
    for a, b in zip(state.rows(), rows):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_migration_temporaries_stay_below_one_copy():
  """A plan change moves rows one block at a time and builds no merged copy of the
  state: its temporaries stay below the state's size."""
  params = {'w': jnp.ones((1 << 16,), jnp.float32)}
  xla = dos_jax.UpdateImpl.XLA
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=1 << 12,
                                                    policy=dos_jax.Stride(2)),
                      implementation=dos_jax.Implementation(program='gpu', device=xla, host=xla))
  state = opt.init(params)
  spec_ = state.layout.spec()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  for policy in (dos_jax.Stride(4), dos_jax.ResidentFraction(0.25, then=dos_jax.Stride(2)),
                 dos_jax.AllDevice()):
    wanted = dos_jax.geometry.partition.for_plan(policy.plan(spec_), two_memories=True)
    fn = jax.jit(lambda s, w=wanted: migration_lib.moved_in_trace(s, w))
    got = fn.lower(state).compile().memory_analysis()
    assert got.temp_size_in_bytes < state_bytes, (policy, got.temp_size_in_bytes, state_bytes)


def test_auto_reports_migration_in_the_step_record():
  from dos_jax.planner import costmodel  # pylint: disable=import-outside-toplevel
  profile = costmodel.H100_PCIE_GEN5_NODE
  s = SubgroupSpec(20, 10**8, 20 * 10**8, 12, 2, 2)
  # Per subgroup in regions holding a lane's rows (beside host subgroups, jax 0.10-0.11)
  # the stream holds every streamed row, as a resident tier would, but only in the
  # update phase: streaming then needs activations to share with
  # (`costmodel.streamed_elements_held`); staged (jax 0.12), one row per lane.
  rows, activations = (10, 4) if lowering_lib.regions_hold_every_row() else (8, 0)
  policy = dos_jax.Auto(profile, budget_bytes=rows * 1.2e9,
                        activation_bytes=activations * 1.2e9, tolerance=0.1, patience=1,
                        warmup=0)
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
