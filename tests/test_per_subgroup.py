"""Per-subgroup storage (`Storage.PER_SUBGROUP`): every subgroup's state its own
buffers, so that a plan change moves only the rows that change tier and holds no tier
twice. The math against optax for every placement mix, exact moves that copy only the
rows changing memory, donated steps across plan changes (the runner's way), one
program per plan, checkpoints and state tools, and the GPU program's streamed rows
chained `buffers` deep."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax import migration as migration_lib
from dos_jax.dataflow import OpKind
from dos_jax.geometry.partition import Tier
from dos_jax.train import config
from dos_jax.train import data
from dos_jax.train import step as step_lib
from dos_jax.train import trainer
from tests.test_adamw import jit_step
from tests.test_adamw import make_pair
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree
from tests.test_checkpoint import SMALL
from tests.test_gpu_program import _update_graph
from tests.test_three_tiers import MIXES
from tests.test_three_tiers import distinct_state

PER_SUBGROUP = dos_jax.Storage.PER_SUBGROUP
ALL = MIXES + [dos_jax.AllHost(), dos_jax.AllDevice(), dos_jax.Stride(2)]


def _plans(layout_spec):
  return [p.plan(layout_spec) for p in (
      dos_jax.Stride(2), dos_jax.Stride(3), dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)),
      dos_jax.AllDevice(), dos_jax.Resident(1, then=dos_jax.Stride(1)), dos_jax.AllHost())]


@pytest.mark.parametrize('policy, impl', [
    *((p, dos_jax.UpdateImpl.KERNEL) for p in ALL),
    *((p, dos_jax.UpdateImpl.XLA) for p in ALL[:2])], ids=repr)
def test_every_mix_matches_optax_fp32(policy, impl, seed):
  ours, ref = make_pair(policy, impl=impl, platform='gpu', storage=PER_SUBGROUP)
  params = ref_params = random_tree(seed)
  state, ref_state = ours.init(params), ref.init(params)
  part = state.partition
  assert part.per_subgroup
  for tier in dos_jax.geometry.partition.TIERS:  # one (1, K, S) array per subgroup and dtype
    assert len(state.tier(tier)) == len(part.ids(tier)) * len(state.slots.groups)
    assert all(x.shape[0] == 1 for x in state.tier(tier))
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(5):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_storage_default_follows_the_policy_and_the_cpu_program_stays_stacked():
  auto = dos_jax.Auto(dos_jax.planner.costmodel.H100_PCIE_GEN5_NODE)
  assert dos_jax.Offload(policy=auto).per_subgroup()
  assert not dos_jax.Offload(policy=dos_jax.Stride(2)).per_subgroup()
  assert dos_jax.Offload(storage=PER_SUBGROUP).per_subgroup()
  assert not dos_jax.Offload(policy=auto, storage=dos_jax.Storage.STACKED).per_subgroup()
  with pytest.raises(TypeError, match='Offload.storage'):
    dos_jax.Offload(storage='per_subgroup')
  ours, _ = make_pair(dos_jax.Stride(2), platform='cpu', storage=PER_SUBGROUP)
  assert not ours.init(random_tree(0)).partition.per_subgroup


class _Alternating:
  """An adaptive policy of the user's own: `plan` and `observe`, nothing of `Auto`."""

  def plan(self, spec):
    return dos_jax.Stride(2).plan(spec)

  def observe(self, plan, measured_update_seconds):
    del measured_update_seconds
    return plan


def test_any_policy_that_re_plans_as_it_runs_is_stored_per_subgroup():
  """The storage default asks the policy (`AdaptivePolicy`: it has `observe`), not
  whether it is the planner's `Auto`."""
  assert isinstance(_Alternating(), dos_jax.AdaptivePolicy)
  assert isinstance(dos_jax.Auto(dos_jax.planner.costmodel.H100_PCIE_GEN5_NODE),
                    dos_jax.AdaptivePolicy)
  assert not isinstance(dos_jax.Stride(2), dos_jax.AdaptivePolicy)
  assert dos_jax.Offload(policy=_Alternating()).per_subgroup()
  assert dos_jax.Offload(policy=_Alternating(), chunks=2).chunks == 2


def test_migration_is_exact_moves_only_the_rows_that_change_memory(seed):
  """`dos_jax.migrate` copies a row only when it changes memory (host <-> device), bit
  for bit; every other row is handed to its new tier as the same array, so a plan
  change holds no tier twice."""
  state, rows = distinct_state(seed, PER_SUBGROUP)
  groups = len(state.slots.groups)
  for plan in _plans(state.layout.spec()):
    wanted = dos_jax.geometry.partition.for_plan(plan, split=True, per_subgroup=True)
    old, state = state, dos_jax.migrate(state, plan)
    assert state.partition == wanted
    before = old.by_subgroup()
    for g, arrays in enumerate(state.by_subgroup()):
      tier = wanted.tier_of(g)
      want = 'device' if tier is Tier.RESIDENT else 'pinned_host'
      assert all(x.sharding.memory_kind == want for x in arrays), (g, tier)
      crossed = (old.partition.tier_of(g) is Tier.RESIDENT) != (tier is Tier.RESIDENT)
      assert all((a is b) != crossed for a, b in zip(arrays, before[g])), (g, crossed)
      assert len(arrays) == groups
    for a, b in zip(state.rows(), rows):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('storage', list(dos_jax.Storage), ids=lambda s: s.value)
def test_donated_steps_across_plan_changes_keep_optax_math_and_compile_once_per_plan(storage, seed):
  """The runner's way: params and state donated, `dos_jax.migrate` between steps when
  the plan changes (host <-> device included), one program per plan."""
  ours, ref = make_pair(dos_jax.AllHost(), platform='gpu', storage=storage)
  params = jax.device_put(random_tree(seed), jax.devices()[0])  # committed, as outputs are
  ref_params = jax.tree.map(jnp.copy, params)  # ours are donated
  state, ref_state = ours.init(params), ref.init(ref_params)
  plans = _plans(state.layout.spec())

  def step(p, s, g, plan):
    u, s = ours.update(g, s, p, plan=plan)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, static_argnames='plan', donate_argnums=(0, 1))
  ref_step = jit_step(ref)
  for i in range(3 * len(plans)):
    plan = plans[(i // 2) % len(plans)]
    grads = random_grads(params, i, seed)
    state = dos_jax.migrate(state, plan)
    params, state = step(params, state, grads, plan=plan)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
    assert state.partition.resident == plan.resident
    assert state.partition.per_subgroup == (storage is PER_SUBGROUP)
  assert step._cache_size() == len(plans)  # pylint: disable=protected-access
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_traced_step_refuses_a_state_laid_out_for_another_plan():
  ours, _ = make_pair(dos_jax.AllHost(), platform='gpu', storage=PER_SUBGROUP)
  params = random_tree(0)
  state = ours.init(params)
  plan = dos_jax.Stride(2).plan(state.layout.spec())
  update = jax.jit(lambda g, s, p: ours.update(g, s, p, plan=plan))
  with pytest.raises(ValueError, match=r'dos_jax.migrate\(opt_state, plan\)'):
    update(random_grads(params, 0, 0), state, params)
  # Eagerly, the update moves the rows itself.
  _, new = ours.update(random_grads(params, 0, 0), state, params, plan=plan)
  assert new.partition.streamed == tuple(sorted(plan.streamed))


def test_a_plan_change_keeps_the_storage():
  ours, _ = make_pair(dos_jax.AllHost(), platform='gpu', storage=PER_SUBGROUP)
  state = ours.init(random_tree(0))
  stacked = dos_jax.geometry.partition.for_plan(dos_jax.Stride(2).plan(state.layout.spec()), True)
  with pytest.raises(ValueError, match='stored per subgroup, the plan asks for stacked'):
    migration_lib.moved_in_trace(state, stacked)


@pytest.mark.parametrize('buffers', [1, 2, 3])
def test_gpu_program_streams_rows_at_most_buffers_deep(buffers):
  """Lowered for 'cuda': the streamed rows form `buffers` chains (row k + buffers
  starts only once row k is back in host memory), so at most `buffers` are in flight
  while rows of different chains are free to overlap; the host region stays
  independent of every one of them."""
  graph = _update_graph(dos_jax.Stride(1, buffers=buffers), jnp.bfloat16, storage=PER_SUBGROUP)
  stream = graph.with_kind(OpKind.PALLAS)
  assert len(stream) >= buffers + 3
  for k, row in enumerate(stream):
    for j, earlier in enumerate(stream[:k]):
      assert graph.depends(row, earlier) == ((k - j) % buffers == 0), (k, j)
  mixed = _update_graph(dos_jax.Stride(2, buffers=buffers), jnp.float32, storage=PER_SUBGROUP)
  host, stream = mixed.with_kind(OpKind.HOST_REGION), mixed.with_kind(OpKind.PALLAS)
  assert host and stream
  for h in host:
    for d in stream:
      assert not mixed.depends(h, d) and not mixed.depends(d, h)


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=300_000, progress=False)
  return out


@pytest.mark.parametrize('storage', list(dos_jax.Storage), ids=lambda s: s.value)
def test_the_trainer_moves_the_state_when_the_plan_changes(dataset, storage, monkeypatch):
  """The runner's steps (params and state donated, output shardings pinned) across
  plan changes of the accelerator program, host <-> device included: the state is moved
  before the step that needs it (timed as `migrate_s`), one program per plan and form,
  and the training is optax's."""
  cfg = config.load(None, [f'data.path={dataset}', *SMALL, 'model.compute_dtype=float32',
                           'model.n_layers=1', 'offload.subgroup_size=20000',
                           'optim.clip_norm=0.5'])
  make_offload = step_lib.make_offload
  monkeypatch.setattr(step_lib, 'make_offload',
                      lambda c, platform=None, data_axis='data', early_chooser=None:
                      dataclasses.replace(make_offload(c, data_axis=data_axis,
                                                       early_chooser=early_chooser),
                                          platform=dos_jax.Program.TWO_MEMORIES, storage=storage))
  run = trainer.build(cfg, devices=jax.devices()[:1])
  ref = trainer.build(cfg, devices=jax.devices()[:1],
                      tx=step_lib.make_optimizer(cfg.optim, None, cfg.train.steps))
  assert run.opt_state.partition.per_subgroup == (storage is PER_SUBGROUP)
  spec = run.opt_state.layout.spec()
  assert spec.num_subgroups >= 4
  plans = [p.plan(spec) for p in (
      dos_jax.ResidentFraction(0.5, then=dos_jax.Stride(2)), dos_jax.AllDevice(),
      dos_jax.AllHost())]
  sampler, ref_sampler = run.train_sampler(), ref.train_sampler()
  for i in range(2 * len(plans)):
    plan = plans[i // 2]
    result = run.step(next(sampler), plan=plan, split=i % 2 == 1)
    ref.step(next(ref_sampler))
    assert (result.migrate_s > 0) == (i % 2 == 0), i
    assert run.opt_state.partition.resident == plan.resident
  assert run.compile_counts() == {'fused': len(plans), 'grad': 1, 'update': len(plans)}
  for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_checkpoint_forms_and_state_tools_work_per_subgroup(seed):
  """Portable pytrees (what the runner's checkpoints hold) cross between the storages
  and plans exactly; flax serialization round-trips; reset_moments keeps the master; the pytree
  keys name each subgroup."""
  from flax import serialization  # pylint: disable=import-outside-toplevel
  master = random_tree(seed)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
  ours, _ = make_pair(MIXES[0], platform='gpu', storage=PER_SUBGROUP)
  # A three-tier target on either side (the target's tiers differ in memory space).
  stacked, _ = make_pair(dos_jax.ResidentFraction(0.5, then=dos_jax.Stride(3)), platform='gpu')
  state = ours.init(params)
  step = jit_step(ours)
  for i in range(2):
    params, state = step(params, state, random_grads(params, i, seed))
  rows = [np.asarray(x) for x in state.rows()]

  trees = dos_jax.state_to_pytrees(state, params)
  other = dos_jax.state_from_pytrees(trees, params, stacked)
  back = dos_jax.state_from_pytrees(dos_jax.state_to_pytrees(other, params), params, ours)
  assert not other.partition.per_subgroup and back.partition == state.partition
  for a, b in zip(back.rows(), rows):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert {x.sharding.memory_kind for x in back.host + back.streamed} == {'pinned_host'}

  restored = serialization.from_bytes(state, serialization.to_bytes(state))
  for a, b in zip(restored.rows(), rows):
    np.testing.assert_array_equal(np.asarray(a), b)

  reset = dos_jax.reset_moments(state)
  master_k = state.slots.places[0][1]
  for a, b in zip(reset.rows(), rows):
    a = np.asarray(a)
    np.testing.assert_array_equal(a[:, master_k], b[:, master_k])
    assert not np.any(np.delete(a, master_k, axis=1))

  paths_ = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert paths_[0].startswith('.subgroups[0]') and any('count' in p for p in paths_)
