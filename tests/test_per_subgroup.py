"""Per-subgroup storage, the two-memory program's one storage: every subgroup's state
its own buffers, so that a plan change moves only the rows that change tier and holds no tier
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
from tests.tooling.ops import OpKind
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

ALL = MIXES + [dos_jax.AllHost(), dos_jax.AllDevice(), dos_jax.Stride(2)]


def _plans(layout_spec):
  return [p.plan(layout_spec) for p in (
      dos_jax.Stride(2), dos_jax.Stride(3), dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(2)),
      dos_jax.AllDevice(), dos_jax.Resident(1, then=dos_jax.Stride(1)), dos_jax.AllHost())]


@pytest.mark.parametrize('policy, impl', [
    *((p, dos_jax.UpdateImpl.KERNEL) for p in ALL),
    *((p, dos_jax.UpdateImpl.XLA) for p in ALL[:2])], ids=repr)
def test_every_mix_matches_optax_fp32(policy, impl, seed):
  ours, ref = make_pair(policy, impl=impl, platform='gpu')
  params = ref_params = random_tree(seed)
  state, ref_state = ours.init(params), ref.init(params)
  part = state.partition
  assert part.two_memories
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


@pytest.mark.parametrize('policy', [dos_jax.Stride(2), dos_jax.AllHost(), MIXES[0]], ids=repr)
def test_the_two_memory_program_is_per_subgroup_and_the_one_memory_program_one_array(
    policy, seed):
  """No field chooses the storage: the program does."""
  params = random_tree(seed)
  gpu, _ = make_pair(policy, platform='gpu')
  assert gpu.init(params).partition.two_memories
  cpu, _ = make_pair(policy, platform='cpu')
  state = cpu.init(params)
  assert not state.partition.two_memories
  assert all(len(state.partition.blocks(t)) == 1 for t in dos_jax.geometry.partition.TIERS)


class _Alternating:
  """An adaptive policy of the user's own: `plan` and `observe`, nothing of `Auto`."""

  def plan(self, spec):
    return dos_jax.Stride(2).plan(spec)

  def observe(self, plan, measured_update_seconds):
    del measured_update_seconds
    return plan


def test_a_policy_that_re_plans_as_it_runs_is_stored_per_subgroup(seed):
  """A user's own adaptive policy (`AdaptivePolicy`: it has `observe`), not the
  planner's `Auto`, gets the same storage."""
  assert isinstance(_Alternating(), dos_jax.AdaptivePolicy)
  assert isinstance(dos_jax.Auto(dos_jax.planner.costmodel.H100_PCIE_GEN5_NODE),
                    dos_jax.AdaptivePolicy)
  assert not isinstance(dos_jax.Stride(2), dos_jax.AdaptivePolicy)
  ours, _ = make_pair(_Alternating(), platform='gpu')
  assert ours.init(random_tree(seed)).partition.two_memories


def test_migration_is_exact_moves_only_the_rows_that_change_memory(seed):
  """`dos_jax.migrate` copies a row only when it changes memory (host <-> device), bit
  for bit; every other row is handed to its new tier as the same array, so a plan
  change holds no tier twice."""
  state, rows = distinct_state(seed)
  groups = len(state.slots.groups)
  for plan in _plans(state.layout.spec()):
    wanted = dos_jax.geometry.partition.for_plan(plan, two_memories=True)
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


def test_donated_steps_across_plan_changes_keep_optax_math_and_compile_once_per_plan(seed):
  """The runner's way: params and state donated, `dos_jax.migrate` between steps when
  the plan changes (host <-> device included), one program per plan."""
  ours, ref = make_pair(dos_jax.AllHost(), platform='gpu')
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
    assert state.partition.two_memories
  assert step._cache_size() == len(plans)  # pylint: disable=protected-access
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_first_step_compiles_once_with_the_pallas_kernel(seed):
  """The streamed rows' Pallas AdamW (interpret mode here) runs for the first time inside
  the first step: nothing that first run loads may change jit's trace context (on jax
  0.12 Pallas's fuser registers an option there), or the second step compiles again."""
  ours, ref = make_pair(dos_jax.Stride(2), platform='gpu')
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  ref_params = jax.tree.map(jnp.copy, params)
  state, ref_state = ours.init(params), ref.init(ref_params)

  def step(p, s, g):
    u, s = ours.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  ref_step = jit_step(ref)
  for i in range(3):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  assert step._cache_size() == 1  # pylint: disable=protected-access
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_traced_step_refuses_a_state_laid_out_for_another_plan(seed):
  ours, _ = make_pair(dos_jax.AllHost(), platform='gpu')
  params = random_tree(seed)
  state = ours.init(params)
  plan = dos_jax.Stride(2).plan(state.layout.spec())
  update = jax.jit(lambda g, s, p: ours.update(g, s, p, plan=plan))
  with pytest.raises(ValueError, match=r'dos_jax.migrate\(opt_state, plan\)'):
    update(random_grads(params, 0, seed), state, params)
  # Eagerly, the update moves the rows itself.
  _, new = ours.update(random_grads(params, 0, seed), state, params, plan=plan)
  assert new.partition.streamed == tuple(sorted(plan.streamed))


@dataclasses.dataclass(frozen=True)
class _Backwards:
  """Every other subgroup streamed, last first (the backward pass's order); the rest on
  the host."""

  buffers: int = 2

  def plan(self, spec):
    n = spec.num_subgroups
    return dos_jax.Plan(streamed=tuple(range(n - 1, -1, -2)),
                        host=tuple(range(n - 2, -1, -2)), buffers=self.buffers)


@pytest.mark.parametrize('buffers', [2, 3])
@pytest.mark.parametrize('impl', list(dos_jax.UpdateImpl), ids=lambda i: i.value)
def test_a_stream_in_any_order_and_lanes_matches_optax(impl, buffers, seed):
  """A stream out of ascending order, over 2 or 3 lanes (`buffers`), 4 streamed rows
  (random_tree's 284 elements in subgroups of 41, decayed and not: 8 subgroups): the
  state keeps the stream's order and the numbers are optax's."""
  ours, ref = make_pair(_Backwards(buffers), subgroup_size=41, impl=impl, platform='gpu')
  params = ref_params = jax.device_put(random_tree(seed), jax.devices()[0])
  state, ref_state = ours.init(params), ref.init(params)
  assert state.partition.stream == (7, 5, 3, 1) and state.partition.buffers == buffers
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(3):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('buffers', [1, 2, 3])
def test_gpu_program_streams_rows_at_most_buffers_deep(buffers, seed):
  """Lowered for 'cuda': the streamed rows form `buffers` chains (row k + buffers
  starts only once row k is back in host memory), so at most `buffers` are in flight
  while rows of different chains are free to overlap; the host region stays
  independent of every one of them."""
  graph = _update_graph(dos_jax.Stride(1, buffers=buffers), jnp.bfloat16, seed)
  stream = graph.with_kind(OpKind.PALLAS)
  assert len(stream) >= buffers + 3
  for k, row in enumerate(stream):
    for j, earlier in enumerate(stream[:k]):
      assert graph.depends(row, earlier) == ((k - j) % buffers == 0), (k, j)
  mixed = _update_graph(dos_jax.Stride(2, buffers=buffers), jnp.float32, seed)
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


@pytest.mark.slow
def test_the_trainer_moves_the_state_when_the_plan_changes(dataset):
  """The runner's steps (params and state donated, output shardings pinned) across
  plan changes of the two-memory program, host <-> device included: the state is moved
  before the step that needs it (timed as `migrate_s`), one program per plan and form,
  and the training is optax's."""
  cfg = config.load(None, [f'data.path={dataset}', *SMALL, 'model.compute_dtype=float32',
                           'model.n_layers=1', 'offload.subgroup_size=20000',
                           'optim.clip_norm=0.5', 'offload.platform=gpu'])
  run = trainer.build(cfg, devices=jax.devices()[:1])
  ref = trainer.build(cfg, devices=jax.devices()[:1],
                      tx=step_lib.make_optimizer(cfg.optim, None, cfg.train.steps))
  assert run.opt_state.partition.two_memories
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
  ours, _ = make_pair(MIXES[0], platform='gpu')
  # A three-tier target on either side (the target's tiers differ in memory space), and
  # the one-memory program's single array.
  other_plan, _ = make_pair(dos_jax.ResidentFraction(0.5, then=dos_jax.Stride(3)),
                            platform='gpu')
  one_array, _ = make_pair(MIXES[0], platform='cpu')
  state = ours.init(params)
  step = jit_step(ours)
  for i in range(2):
    params, state = step(params, state, random_grads(params, i, seed))
  rows = [np.asarray(x) for x in state.rows()]

  trees = dos_jax.state_to_pytrees(state, params)
  for target in (other_plan, one_array):
    other = dos_jax.state_from_pytrees(trees, params, target)
    back = dos_jax.state_from_pytrees(dos_jax.state_to_pytrees(other, params), params, ours)
    assert other.partition != state.partition and back.partition == state.partition
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
