"""Pipeline parallelism on CPU devices: the GPipe program computes the model's loss and
gradients; pipelined training (pipeline=2 x data=2, pipeline=4) matches pipeline=1 step
for step, clipping included; each stage's state lives on its own devices; checkpoints
cross pipeline shapes; bad shapes get one line naming the key."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dos_jax.planner import stages as stages_lib
from dos_jax.train import checkpoint, config, data, model, pipeline, trainer
from dos_jax.train.configlib import ConfigError

SMALL = [
    'model.n_layers=4', 'model.compute_dtype=float32', 'data.seq_len=32', 'data.batch_size=8',
    'optim.lr=3e-3', 'optim.warmup_steps=2', 'train.steps=12', 'offload.policy=stride',
    # Small enough that most steps clip: the clip factor must match too.
    'optim.clip_norm=2.0',
]
needs4 = pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices')


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=300_000, progress=False)
  return out


def _build(dataset, data_size, stages, microbatches, devices):
  sets = [f'data.path={dataset}', *SMALL, f'mesh.data={data_size}', f'mesh.pipeline={stages}']
  if stages > 1:
    sets.append(f'train.microbatches={microbatches}')
  return trainer.build(config.load(None, sets), devices=jax.devices()[:devices])


def _close(got, want, atol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@needs4
# (data x pipeline in fp32 is the training test's; here tensor inside stages, and bf16.)
@pytest.mark.parametrize('mesh_shape, microbatches, dtype', [
    pytest.param((1, 2, 2), 3, 'float32', id='tensor2xpipe2'),
    pytest.param((2, 1, 2), 2, 'bfloat16', id='data2xpipe2-bf16', marks=pytest.mark.slow)])
def test_gpipe_loss_and_grads_equal_the_model(mesh_shape, microbatches, dtype, seed):
  """The pipelined forward/backward against the plain model on fresh random params and
  tokens: the same loss and gradients (fp32: only summation order differs; bf16: the
  gradients' bf16 roundings differ by microbatch, so looser)."""
  cfg = model.ModelConfig(dim=32, ffn_dim=64, n_layers=4, n_heads=2, vocab_size=64,
                          compute_dtype=dtype)
  apply, params = model.build_model(cfg, seed)
  batch = 6 * mesh_shape[0] if microbatches == 3 else 8
  tokens = np.random.default_rng(seed).integers(0, 64, (batch, 17))
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: model.loss_fn(apply, p, tokens)[0]))(params)

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(mesh_shape), ('data', 'tensor', 'pipeline'))
  shape = pipeline.make_shape(4, mesh_shape[2], microbatches)
  piped = pipeline.to_pipelined(params, shape)
  specs = pipeline.pipelined_specs(piped)
  piped = jax.device_put(piped, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                             is_leaf=lambda x: isinstance(x, P)))
  papply = pipeline.make_apply(cfg, mesh, shape)
  loss, grads = jax.jit(jax.value_and_grad(
      lambda p: model.loss_fn(papply, p, tokens)[0]))(piped)
  fp32 = dtype == 'float32'
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6 if fp32 else 1e-3)
  want = pipeline.to_pipelined(ref_grads, shape)
  if fp32:
    _close(grads, want, atol=1e-6)
  else:
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      b = np.asarray(b)
      assert np.linalg.norm(np.asarray(a) - b) <= 2e-2 * np.linalg.norm(b) + 1e-6
  # Canonical -> pipelined -> canonical is the identity.
  back = pipeline.make_from_pipelined(shape, mesh, specs)(piped)
  _close(back, params, atol=0)


@pytest.mark.slow
@needs4
def test_pipelined_training_matches_one_stage_and_checkpoints_cross_shapes(dataset, tmp_path):
  """10 steps of pipeline=2 x data=2 and of pipeline=4 against pipeline=1 on the same
  batches: losses, gradient norms (clipped steps included) and params; then a checkpoint
  written by the pipeline=2 run restores under pipeline=4 and under no pipeline."""
  one = _build(dataset, 1, 1, 1, 1)
  two = _build(dataset, 2, 2, 2, 4)
  four = _build(dataset, 1, 4, 4, 4)
  sampler = one.train_sampler()
  clipped = 0
  for i in range(10):
    batch = next(sampler)
    a = one.step(batch)
    for run in (two, four):
      b = run.step(batch, split=i % 2 == 0)
      np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
      np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=1e-5)
    clipped += a.grad_norm > 2.0
  assert 0 < clipped < 10, clipped  # Both clipped and unclipped steps were compared.
  for run in (two, four):
    _close(run.params, one.params, atol=2e-5)
    assert all(n == 1 for n in run.compile_counts().values()), run.compile_counts()

  # Each stage's state: on that stage's devices only, in host memory, split over data.
  for s, state in enumerate(two.opt_state.states):
    stage_devices = set(pipeline.stage_mesh(two.mesh, s).devices.flat)
    for leaf in jax.tree.leaves(state):
      assert set(leaf.sharding.device_set) == stage_devices
    host = [x for x in jax.tree.leaves(state)
            if x.ndim == 3 and x.size and x.sharding.memory_kind == 'pinned_host']
    assert host
    for leaf in host:
      assert leaf.sharding.spec == P(None, None, 'data'), leaf.sharding  # ZeRO-1 in the stage.

  ckpt = checkpoint.Checkpointer(str(tmp_path / 'ckpt'), keep=2, async_save=False)
  try:
    ckpt.save(10, params=two.params, opt_state=two.opt_state, meta={'step': 10})
    ckpt.wait()
    want_state = checkpoint.state_to_trees(two.opt_state, two.params)
    batch = next(sampler)
    after = two.step(batch)
    # Into the other shapes' runs (whose state differs from it in rounding only, so
    # that the exact comparison below shows the checkpoint's values arrived).
    for other in (four, one):
      mine = checkpoint.state_to_trees(other.opt_state, other.params)
      assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in
                 zip(jax.tree.leaves(mine), jax.tree.leaves(want_state)))
      restored = ckpt.restore(10, params=other.params, opt_state=other.opt_state, tx=other.tx)
      other.set_state(restored.params, restored.opt_state)
      _close(checkpoint.state_to_trees(other.opt_state, other.params), want_state, atol=0)
      np.testing.assert_allclose(other.step(batch).loss, after.loss, rtol=1e-6)
  finally:
    ckpt.close()


def test_bad_pipeline_shapes_name_the_key(dataset):
  with pytest.raises(ConfigError, match=r'mesh.pipeline: 3 stages do not split model.n_layers=4'):
    pipeline.make_shape(4, 3, 1)
  shape = pipeline.make_shape(4, 2, 3)
  with pytest.raises(ConfigError, match=r'train.microbatches: data.batch_size=8 does not split'):
    pipeline.check_batch(shape, 8, 2)
  if jax.device_count() >= 2:
    with pytest.raises(ConfigError, match='offload.policy: auto is not supported'):
      trainer.build(config.load(None, [f'data.path={dataset}', *SMALL, 'mesh.pipeline=2',
                                       'mesh.data=1', 'offload.policy=auto']),
                    devices=jax.devices()[:2])


def test_bubble_fraction_and_stage_sizes():
  assert stages_lib.bubble_fraction(1, 8) == 0
  for s, m in [(2, 4), (4, 8), (8, 1)]:
    assert stages_lib.bubble_fraction(s, m) == pytest.approx((s - 1) / (m + s - 1))
  shape = model.ModelConfig(preset='tiny').shape()
  sizes = stages_lib.stage_sizes(
      shape, stages=2, microbatches=4, devices=4, param_bytes=4, state_bytes=8,
      layer_activation_bytes=1000.0)
  # Every parameter is on exactly one stage; the stage halves split the layers.
  assert sum(z.num_params for z in sizes) == shape.num_params()
  assert [(z.first_layer, z.last_layer) for z in sizes] == [(0, 1), (2, 3)]
  assert sizes[0].params == pytest.approx(sizes[0].num_params / 2 * 4, abs=4)
  with pytest.raises(ValueError, match='3 stages do not split 4 layers'):
    stages_lib.stage_sizes(shape, stages=3, microbatches=1, devices=3, param_bytes=4,
                           state_bytes=8, layer_activation_bytes=1000.0)


def test_plan_reports_the_bubble_and_each_stage(capsys):
  from dos_jax import cli  # pylint: disable=import-outside-toplevel
  code = cli.main(['plan', '--model', '7b', '--gpus-per-node', '8', '--pipeline', '4',
                   '--microbatches', '8'])
  out = capsys.readouterr().out
  assert code == 0
  assert f'bubble {3 / 11:.1%} of each step' in out
  rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
          and len(line.split()) == 11]
  assert [r[1] for r in rows] == ['0-7', '8-15', '16-23', '24-31']
  assert cli.main(['plan', '--model', '7b', '--pipeline', '3']) == 2
  assert 'do not split 32 layers' in capsys.readouterr().err
