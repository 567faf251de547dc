"""The train step: clipping as optax does it, dos_jax == optax, no recompiles, loss falls,
sharded == 1 device, adaptive plans compile once each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.train import config, data, loop, model, placement, step, trainer
from dos_jax.train.progress import read_metrics

# Two layers instead of four: the same code, compiled in half the time.
SMALL = [
    'model.n_layers=2',
    'data.seq_len=32', 'data.batch_size=8', 'optim.warmup_steps=5', 'train.steps=20',
    'optim.lr=3e-3',
]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=1_000_000, progress=False)
  return out


def _cfg(dataset, *overrides):
  return config.load(None, [f'data.path={dataset}', *SMALL, *overrides])


def test_clip_matches_optax_and_reports_the_unclipped_norm(seed):
  rng = np.random.default_rng(seed)
  grads = {
      'a': jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
      'b': {'c': jnp.asarray(rng.normal(size=(3,)), jnp.float32)},
      's': jnp.asarray(rng.normal(), jnp.float32),
  }
  norm64 = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
  for max_norm in (norm64 * 0.3, norm64 * 3.0):
    clipped, norm = step.clip_by_global_norm(grads, float(max_norm))
    expected, _ = optax.clip_by_global_norm(float(max_norm)).update(grads, optax.EmptyState())
    np.testing.assert_allclose(float(norm), norm64, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(clipped), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  unclipped, _ = step.clip_by_global_norm(grads, None)
  assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), unclipped, grads))


def test_schedule_warms_up_then_decays_to_the_floor():
  cfg = config.OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
  schedule = step.make_schedule(cfg, total_steps=50)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(float(schedule(10)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(50)), 1e-4, rtol=1e-5)
  flat = step.make_schedule(config.OptimConfig(lr=1e-3, schedule='constant', warmup_steps=4), 50)
  np.testing.assert_allclose(float(flat(30)), 1e-3, rtol=1e-6)


@pytest.mark.slow
def test_four_devices_match_one(dataset):
  """data=2 x tensor=2 on 4 CPU devices against 1 device, fp32 compute so that only the
  order of reductions differs: losses to 1e-5 relative, params to 1e-5 absolute."""
  common = ['model.compute_dtype=float32', 'train.steps=6']
  one = trainer.build(_cfg(dataset, *common, 'mesh.data=1'), devices=jax.devices()[:1])
  four = trainer.build(
      _cfg(dataset, *common, 'mesh.data=2', 'mesh.tensor=2'), devices=jax.devices()[:4]
  )
  assert dict(four.mesh.shape) == {'data': 2, 'tensor': 2, 'pipeline': 1}
  sampler = one.train_sampler()
  for _ in range(6):
    batch = next(sampler)
    a, b = one.step(batch), four.step(batch)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
    np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=1e-4)
  for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
  wq = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(four.params)
        if 'wq' in jax.tree_util.keystr(path)][0]
  assert wq.sharding.spec[1] == 'tensor'  # Really split, not replicated.
  assert four.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}


def test_dos_jax_matches_optax_adamw_and_the_loss_falls(dataset):
  """The runner with dos_jax's AdamW (AllHost, Stride(2), AllDevice) against the same
  runner with `offload.policy=none` (plain `optax.adamw` after the step's clip, state on
  the device): same seed and batches, losses to 1e-5 relative over 20 steps, the loss
  falls from ln(256) by more than 1.5, and the one-program step never recompiles.

  fp32 compute: with bf16 activations a 1-ulp difference in an fp32 update (XLA fuses
  the two optimizers' element-wise ops differently) can flip a bf16 rounding, and over
  20 steps that grows to ~5e-4 in the loss, which would hide real differences.
  """
  common = [
      'offload.stride=2', 'offload.subgroup_size=100000', 'train.steps=20',
      'model.compute_dtype=float32',
  ]
  runs = {
      policy: trainer.build(_cfg(dataset, *common, f'offload.policy={policy}'),
                            devices=jax.devices()[:1])
      for policy in ('all_host', 'stride', 'all_device', 'none')
  }
  reference = runs.pop('none')
  assert not any(isinstance(x, dos_jax.OffloadedState) for x in jax.tree.leaves(
      reference.opt_state, is_leaf=lambda x: isinstance(x, dos_jax.OffloadedState)))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(reference.opt_state)} == {'device'}
  assert runs['stride'].opt_state.layout.num_subgroups >= 4  # Stride(2) really splits.
  sampler = reference.train_sampler()
  losses = {name: [] for name in (*runs, 'none')}
  for _ in range(20):
    batch = next(sampler)
    losses['none'].append(reference.step(batch).loss)
    for name, run in runs.items():
      losses[name].append(run.step(batch).loss)
  for name, run in runs.items():
    np.testing.assert_allclose(losses[name], losses['none'], rtol=1e-5, err_msg=name)
    assert run.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}
  assert reference.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}
  assert abs(losses['none'][0] - np.log(256)) < 0.3  # A fresh model is near uniform.
  assert np.mean(losses['stride'][-5:]) < losses['stride'][0] - 1.5, losses['stride']
  assert np.isfinite(runs['stride'].evaluate(2))


def test_policy_none_is_plain_optax_adamw_with_the_same_hyperparameters():
  cfg = config.load(None, ['offload.policy=none', 'optim.mu_dtype=bfloat16'])
  assert cfg.offload.placement is None
  tx = step.make_optimizer(cfg.optim, cfg.offload, 100)
  assert not step.scales_in_update(tx)  # the step clips the gradients first
  params = {'w': jnp.ones((3, 4)), 'scale': jnp.ones((4,))}
  state = tx.init(params)
  mu = optax.tree.get(state, 'mu')
  assert mu['w'].dtype == jnp.bfloat16
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  ref = optax.adamw(step.make_schedule(cfg.optim, 100), b1=cfg.optim.b1, b2=cfg.optim.b2,
                    eps=cfg.optim.eps, mu_dtype=jnp.bfloat16,
                    weight_decay=cfg.optim.weight_decay, mask=step.decay_mask)
  ref_state = ref.init(params)
  for _ in range(12):  # past the warmup, so lr and decay are nonzero
    got, state = tx.update(grads, state, params)
    want, ref_state = ref.update(grads, ref_state, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(got['w'], got['scale'][None, :])  # decay on matrices only


def test_one_program_step_matches_the_two_program_form(dataset):
  """The fused step (forward to applied update in one program, the clip factor handed
  to the update as `grad_scale`) against the split pair (gradients, then update) and
  against the loop's mix of the two: same losses to 1e-6 over 20 steps, with clipping
  active in some steps only; state moves between the forms without a recompile.

  Stride(2) only: its step runs both a host tier and a streamed tier, so it covers what
  an AllHost run (the host tier alone) would; AllHost's fused step is checked against
  optax in `test_dos_jax_matches_optax_adamw_and_the_loss_falls`."""
  cfg = _cfg(dataset, 'offload.policy=stride', 'offload.subgroup_size=100000',
             'model.compute_dtype=float32', 'optim.clip_norm=2.0')
  runs = {name: trainer.build(cfg, devices=jax.devices()[:1]) for name in ('fused', 'split', 'mix')}
  sampler = runs['fused'].train_sampler()
  losses = {name: [] for name in runs}
  norms = []
  for i in range(20):
    batch = next(sampler)
    for name, run in runs.items():
      split = name == 'split' or (name == 'mix' and i % 3 == 0)
      result = run.step(batch, split=split)
      assert result.split == split and (result.update_s is not None) == split
      losses[name].append(result.loss)
      if name == 'fused':
        norms.append(result.grad_norm)
  clipped = [n > cfg.optim.clip_norm for n in norms]
  assert any(clipped) and not all(clipped), norms
  for name in ('split', 'mix'):
    np.testing.assert_allclose(losses[name], losses['fused'], rtol=1e-6, err_msg=name)
    for x, y in zip(jax.tree.leaves(runs['fused'].params), jax.tree.leaves(runs[name].params)):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
  assert runs['fused'].compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}
  assert runs['split'].compile_counts() == {'fused': 0, 'grad': 1, 'update': 1}
  assert runs['mix'].compile_counts() == {'fused': 1, 'grad': 1, 'update': 1}


@pytest.mark.slow
def test_split_form_hands_the_clip_factor_to_the_update(dataset):
  """The gradient program does not scale the gradients for dos_jax (the update does,
  as `grad_scale`), but does for `optax.adamw`, which has no `grad_scale`."""
  cfg = _cfg(dataset, 'offload.policy=stride', 'offload.subgroup_size=100000',
             'optim.clip_norm=0.5')
  ours = trainer.build(cfg, devices=jax.devices()[:1])
  reference = trainer.build(
      cfg, devices=jax.devices()[:1], tx=step.make_optimizer(cfg.optim, None, cfg.train.steps)
  )
  assert step.scales_in_update(ours.tx) and not step.scales_in_update(reference.tx)
  tokens = ours.place_batch(next(ours.train_sampler()))
  grads, grad_scale, stats = ours.grad_step(ours.params, tokens)
  norm = float(stats['grad_norm'])
  assert norm > 0.5
  np.testing.assert_allclose(float(optax.tree.norm(grads)), norm, rtol=1e-5)
  np.testing.assert_allclose(float(grad_scale), 0.5 / norm, rtol=1e-6)
  ref_grads, ref_scale, ref_stats = reference.grad_step(reference.params, tokens)
  assert ref_scale is None
  np.testing.assert_allclose(float(ref_stats['grad_norm']), norm, rtol=1e-6)
  np.testing.assert_allclose(float(optax.tree.norm(ref_grads)), 0.5, rtol=1e-5)
  unclipped = trainer.build(_cfg(dataset, 'optim.clip_norm=null'), devices=jax.devices()[:1])
  assert unclipped.grad_step(unclipped.params, tokens)[1] is None  # No grad_scale at all.


def test_one_program_step_donates_params_and_state_and_never_recompiles(dataset):
  """The fused step updates in place: the input params and optimizer state (host
  state included) are deleted by the call; later steps reuse the one compilation."""
  run = trainer.build(_cfg(dataset, 'offload.policy=stride', 'offload.subgroup_size=100000'),
                      devices=jax.devices()[:1])
  sampler = run.train_sampler()
  assert 'pinned_host' in {x.sharding.memory_kind for x in jax.tree.leaves(run.opt_state)}
  for i in range(4):
    params, opt_state = jax.tree.leaves(run.params), jax.tree.leaves(run.opt_state)
    result = run.step(next(sampler))
    assert all(x.is_deleted() for x in params + opt_state)
    assert result.compiled == (i == 0)
    assert run.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}


def test_auto_asks_for_measurements_until_its_plan_is_confirmed():
  """`Auto.wants_measurement`: after (re)planning, until a measurement within
  tolerance confirms the plan, and again while departures accumulate."""
  profile = dos_jax.HardwareProfile(
      name='synthetic', h2d_gbps=20.0, d2h_gbps=20.0, both_gbps=20.0,
      host_adamw_gparams_by_threads={8: 2.0}, device_adamw_gparams=60.0,
      device_free_bytes=40e9, host_copy_slowdown=1.0,
  )
  policy = dos_jax.Auto(profile, warmup=1, patience=2)
  assert not policy.wants_measurement()  # Not planned yet: nothing to measure.
  plan = policy.plan(dos_jax.SubgroupSpec(8, 10**6, 8 * 10**6, 12, 2, 2))
  predicted = policy.prediction.update_seconds
  assert policy.wants_measurement()
  assert policy.observe(plan, 10 * predicted) == plan  # Skipped: it compiled.
  assert policy.wants_measurement()
  policy.observe(plan, predicted)
  assert not policy.wants_measurement()  # Confirmed.
  policy.observe(plan, 3 * predicted)
  assert policy.wants_measurement()  # A departure: the next one decides.
  policy.observe(plan, predicted)
  assert not policy.wants_measurement()


def test_loop_times_the_update_on_logged_steps_only(dataset, tmp_path):
  """With a fixed policy the loop runs the logged steps split (their metrics carry a
  measured update time) and the others fused; the summary says how many were split."""
  out_dir = tmp_path / 'run'
  cfg = _cfg(dataset, 'train.steps=7', 'train.log_every=3', 'train.eval_batches=1',
             'checkpoint.every=0', f'train.out_dir={out_dir}')
  summary = loop.train(cfg, devices=jax.devices()[:1])
  records = [r for r in read_metrics(str(out_dir / 'metrics.jsonl')) if 'loss' in r]
  assert [(r['step'], r['split']) for r in records] == [(1, True), (3, True), (6, True), (7, True)]
  assert all(r['update_s'] > 0 and r['grad_s'] > 0 for r in records)
  assert summary.split_steps == 4 and summary.update_s > 0 and summary.step_s > 0


class _Alternate:
  """A real adaptive policy: alternates Stride(2) and AllHost plans every step."""

  def plan(self, spec):
    self.spec = spec
    return dos_jax.Stride(2).plan(spec)

  def observe(self, plan, measured_update_seconds):
    assert measured_update_seconds > 0
    stride = dos_jax.Stride(2).plan(self.spec)
    return dos_jax.AllHost().plan(self.spec) if plan == stride else stride


def test_adaptive_plans_compile_once_each_and_keep_the_math(dataset):
  """The loop's hook for `Auto`: each step's plan is a static argument; switching plans
  compiles each plan once in each form (fused, split) and gives the same training as
  one fixed plan. Only split steps are measured and reach the policy."""
  cfg = _cfg(dataset, 'offload.policy=stride', 'offload.subgroup_size=100000',
             'model.compute_dtype=float32')
  switching = trainer.build(cfg, devices=jax.devices()[:1])
  fixed = trainer.build(cfg, devices=jax.devices()[:1])
  driver = placement.PlanDriver(_Alternate(), switching.opt_state)
  assert driver.wants_measurement()  # No `wants_measurement`: measured every step.
  assert placement.PlanDriver(dos_jax.Stride(2), fixed.opt_state).plan is None
  sampler = fixed.train_sampler()
  plans = set()
  for step_number in range(1, 9):
    batch = next(sampler)
    plans.add(driver.plan)
    # Split, fused, split, ...: the plan changes after each split step, so each plan
    # runs in both forms.
    result = switching.step(batch, plan=driver.plan, split=step_number % 2 == 1)
    assert result.split == (step_number % 2 == 1)
    metrics = driver.observe(step_number, result.update_s)
    assert metrics['offload/plan'] in {p.describe() for p in plans}
    np.testing.assert_allclose(result.loss, fixed.step(batch).loss, rtol=1e-6)
  assert len(plans) == 2
  assert switching.compile_counts() == {'fused': 2, 'grad': 1, 'update': 2}


def test_auto_policy_through_the_loop_logs_the_cost_model(dataset, tmp_path, monkeypatch):
  """`offload.policy: auto` (the cost model's Auto): the loop hands it each step's update
  time and logs its per-step record, predicted next to measured."""
  monkeypatch.setenv('DOS_JAX_CACHE_DIR', str(tmp_path / 'profile'))  # Calibrates afresh.
  out_dir = tmp_path / 'run'
  cfg = _cfg(dataset, 'offload.policy=auto', 'offload.subgroup_size=null', 'train.steps=4',
             'train.log_every=1', 'train.eval_batches=1', f'train.out_dir={out_dir}')
  assert isinstance(cfg.offload.placement, dos_jax.Auto)
  summary = loop.train(cfg, devices=jax.devices()[:1])
  assert summary.final_step == 4
  records = [r for r in read_metrics(str(out_dir / 'metrics.jsonl')) if 'loss' in r]
  assert [r['step'] for r in records] == [1, 2, 3, 4]
  for r in records:
    assert r['offload/predicted_s'] > 0 and r['offload/measured_s'] == r['update_s']
    assert 'subgroups' in r['offload/plan']


def test_step_compiled_with_early_windows_is_the_jitted_step(dataset):
  """The runner's step on a GPU (`make_train_step(early_windows=True)`: each plan
  compiled by `dataflow.compile_step`) gives the jitted step's numbers bit for bit,
  donates, and compiles once per plan. Here on the CPU the program has no early host
  call, so the second compile is the compiled tests' (test_compiled_early_calls.py)."""
  cfg = _cfg(dataset, 'offload.policy=stride', 'offload.subgroup_size=100000')
  runs = [trainer.build(cfg, devices=jax.devices()[:1]) for _ in range(2)]
  aot = runs[1]
  aot.train_step = step.make_train_step(
      aot.apply, model.loss_fn, aot.tx, clip_norm=cfg.optim.clip_norm,
      param_shardings=aot.param_shardings, state_shardings=aot.state_shardings,
      early_windows=True)
  samplers = [r.train_sampler() for r in runs]
  for i in range(3):
    inputs = jax.tree.leaves((aot.params, aot.opt_state))
    results = [r.step(next(s)) for r, s in zip(runs, samplers)]
    assert all(x.is_deleted() for x in inputs)
    assert results[1].compiled == (i == 0)
    assert aot.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}
  for a, b in zip(jax.tree.leaves((runs[0].params, runs[0].opt_state)),
                  jax.tree.leaves((aot.params, aot.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
