"""The planner's memory of one step (`planner.step_memory`, `memory.activation_bytes`)
and the cost model's exposed last gradient, against hand counts, the packed layout the
optimizer really builds, and (where the CUDA plugin is installed) the step compiled for
an H100."""


import jax
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax import dataflow
from dos_jax.geometry import layout
from dos_jax import model_shapes
from dos_jax.planner import costmodel
from dos_jax.planner import memory
from dos_jax.planner import step_memory
from dos_jax.policies import SubgroupSpec
from dos_jax.train import config as config_lib
from dos_jax.train import model as model_lib
from dos_jax.train import step as step_lib
from tests import compiled as tests_compiled

MIB = 2**20


def _cfg(*overrides):
  return config_lib.load(None, ['offload.subgroup_size=65536', *overrides])


def test_activations_of_tiny_match_the_compiled_buffers_counted_by_hand():
  # The buffers live at the start of the backward pass of the tiny step compiled for an
  # H100 (RESULTS.md, 2026-11-24), s=128, b=32, h=128, f=384, 4 heads, V=256, bf16:
  # per layer 9 x 1 MiB (s b h) + 3 x 3 MiB (s b f) + 8 MiB f32 + 4 MiB bf16 scores.
  shape = model_lib.ModelConfig(preset='tiny').shape()
  per_layer = (9 * 1 + 3 * 3 + 8 + 4) * MIB
  assert memory.layer_activation_bytes(shape, seq_len=128, micro_batch=32) == per_layer
  # 4 layers, the last layer's score gradient (8 + 4 MiB), logits and their gradient.
  assert memory.activation_bytes(shape, seq_len=128, micro_batch=32) == (
      4 * per_layer + 12 * MIB + 2 * 4 * MIB)
  # Remat keeps each block's input (1 MiB) and rebuilds one block at a time.
  assert memory.activation_bytes(shape, seq_len=128, micro_batch=32, remat=True) == (
      4 * MIB + per_layer + 12 * MIB + 8 * MIB)
  # float32 compute: the scores have no second copy.
  assert memory.layer_activation_bytes(shape, seq_len=128, micro_batch=32,
                                       compute_bytes=4) == (9 * 2 + 3 * 6 + 8) * MIB


def test_activations_follow_the_compute_dtype_not_the_params():
  shape = model_lib.ModelConfig(preset='125m').shape()
  kw = dict(state_bytes=8, devices=1, seq_len=256, micro_batch=2)
  bf16 = memory.sizing(shape, param_bytes=2, **kw)
  fp32 = memory.sizing(shape, param_bytes=4, **kw)
  assert bf16.activations == fp32.activations
  assert fp32.params == 2 * bf16.params


@pytest.mark.parametrize('preset, dtype, subgroup', [
    ('tiny', 'bfloat16', 65536), ('tiny', 'float32', 100_000), ('125m', 'bfloat16', 4 << 20),
    ('tiny', 'float32', 10**8)])
def test_run_spec_is_the_layout_the_optimizer_packs(preset, dtype, subgroup):
  cfg = config_lib.load(None, [f'model.preset={preset}', f'model.param_dtype={dtype}',
                               f'offload.subgroup_size={subgroup}'])
  params = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  flags = tuple(jax.tree.leaves(step_lib.decay_mask(params)))
  want = layout.make_layout(params, subgroup, decay_flags=flags).spec()
  assert step_memory.run_spec(cfg) == want


def test_host_temp_and_update_phase_by_hand():
  # tiny, bf16, 15 rows of 65536 (14 decayed + 1 of 1152 norm scales), Stride(2): rows
  # 0, 2, ..., 14 streamed, 7 odd rows of 65536 on the host.
  cfg = _cfg('offload.policy=stride', 'model.param_dtype=bfloat16')
  got = step_memory.predict_step(cfg)
  s = 65536
  # The host rows' gradient pieces (bf16); the state is updated in its own buffer.
  assert got.host_temp_bytes == 7 * s * 2
  # Packing: every gradient leaf, the flat device-bound gradients and their rows, and
  # the host rows' new params. The device loop: its rows' gradients, the stream (stored
  # per subgroup in stream regions, every streamed row's state and the params it packs;
  # on a jax without stream regions, `buffers` rows of state) and every subgroup's new
  # params. The update phase holds the larger.
  n = 918656
  packing = n * 2 + 2 * 8 * s * 2 + 7 * s * 2
  stream = 8 * s * (12 + 2) if lowering_lib.regions_hold_every_row() else 2 * s * 12
  assert got.update_temp == max(packing, 8 * s * 2 + stream + 15 * s * 2)
  assert got.arguments == n * 2 + 4 * 32 * 129
  assert got.device_bytes == got.arguments + got.backward_temp  # activations dominate
  # AllHost in fp32: the host pulls gradients and params, and nothing is packed.
  cfg = _cfg('offload.policy=all_host', 'model.param_dtype=float32')
  got = step_memory.predict_step(cfg)
  assert got.host_temp_bytes == n * 8
  assert got.update_temp == 15 * s * 4


def test_the_last_gradient_is_never_hidden():
  profile = costmodel.H100_PCIE_GEN5_NODE
  spec = SubgroupSpec(num_subgroups=4, subgroup_size=10**8, num_elements=4 * 10**8,
                      state_bytes_per_element=12, param_bytes_per_element=2,
                      grad_bytes_per_element=2)
  plan = dos_jax.AllHost().plan(spec)
  d2h = profile.d2h_gbps * 1e9
  everything = costmodel.predict(profile, spec, plan, backward_seconds=100.0)
  assert everything.grad_transfer_hidden_seconds == pytest.approx(2 * 4e8 / d2h)
  last = 2 * 5e7  # e.g. a 50M-element embedding, all host-bound
  tail = costmodel.predict(profile, spec, plan, backward_seconds=100.0, last_grad_bytes=last)
  assert tail.grad_transfer_hidden_seconds == pytest.approx((2 * 4e8 - last) / d2h)
  assert tail.update_seconds > everything.update_seconds
  # Half the subgroups on the host: half the last gradient is theirs to copy (at the
  # rate of both directions at once, as the streamed half copies too).
  half = dos_jax.Stride(2).plan(spec)
  both = profile.both_gbps * 1e9
  assert costmodel.predict(
      profile, spec, half, backward_seconds=100.0, last_grad_bytes=last
  ).grad_transfer_hidden_seconds == pytest.approx((2 * 2e8 - last / 2) / both)


@pytest.mark.compiled_gpu
@pytest.mark.parametrize('policy, dtype', [('stride', 'bfloat16'), ('all_host', 'float32')])
def test_prediction_within_10_percent_of_the_compiled_h100_step(policy, dtype):
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}')
  if jax.default_backend() != 'cpu':
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu')
  cfg = _cfg(f'offload.policy={policy}', f'model.param_dtype={dtype}', 'model.n_layers=2',
             'optim.clip_norm=1.0')
  compiled = tests_compiled.compile_step(cfg).memory
  predicted = step_memory.predict_step(cfg)
  assert predicted.device_bytes == pytest.approx(compiled.device_peak_bytes, rel=0.10)
  # The host update is in place: host temp is what it reads (gradient pieces, fp32
  # params).
  assert predicted.host_temp_bytes == pytest.approx(compiled.host_temp_bytes, rel=0.10)


def test_zero3_adds_the_gathered_matrices_to_a_devices_activations_by_hand():
  # tiny (4 layers, bf16) over fsdp=4, 32 sequences of 128: a device's 8 sequences of
  # activations, as one device would hold them (the model keeps them batch-split), plus
  # every layer's gathered matrices in bf16 (kept from the forward pass without remat).
  cfg = config_lib.load(None, ['mesh.data=1', 'mesh.fsdp=4', 'model.param_dtype=bfloat16',
                               'model.attention=cudnn'])
  shape = cfg.model.shape()
  acts = memory.activation_bytes(shape, seq_len=128, micro_batch=8, attention='cudnn')
  matrices = shape.num_params() - shape.vocab_size * shape.dim
  got = step_memory.predict_step(cfg, devices=4).backward_temp
  assert got == acts + 2 * matrices


def _update_bound_cfg(*overrides):
  """An update-bound step (4 layers, 32 tokens, bf16, Stride(2), clipping) stored per
  subgroup, for the compiled memory tests; skips where no stream region is compiled."""
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}')
  if jax.default_backend() != 'cpu':
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu')
  return _cfg('offload.policy=stride', 'model.param_dtype=bfloat16', 'model.n_layers=4',
              'optim.clip_norm=1.0', 'data.seq_len=32', 'data.batch_size=2', *overrides)


def _compile(cfg):
  return tests_compiled.compile_step(cfg)


@pytest.mark.compiled_gpu
@pytest.mark.parametrize('subgroup_size', [16384, 65536])
def test_per_subgroup_stream_holds_every_streamed_row(subgroup_size):
  """Stored per subgroup, the device tiers run in stream regions, and XLA keeps each
  value of a region live until its done: the update phase holds every streamed row's
  state (and the params it packs), not `buffers` rows. An update-bound step (short
  sequences, bf16, Stride(2)) compiled for an H100 is within 10% of that prediction."""
  cfg = _update_bound_cfg(f'offload.subgroup_size={subgroup_size}')
  compiled = _compile(cfg).memory.device_peak_bytes
  assert step_memory.predict_step(cfg).device_bytes == pytest.approx(compiled, rel=0.10)


def test_a_stream_that_does_not_fit_is_named_before_xla_allocates():
  """A fixed placement whose per-subgroup stream (every streamed row at once) does not
  fit the device memory beside the model fails up front with one line naming
  `offload.policy`; the same plan fits with room to spare, and a stream without stream
  regions (a jax that builds none), which holds `buffers` rows, needs less. The
  two-memory program's state, built abstractly; the device memory is given."""
  from dos_jax.train import optimizer as optimizer_lib  # pylint: disable=import-outside-toplevel
  from dos_jax.train.config import ConfigError  # pylint: disable=import-outside-toplevel
  if not lowering_lib.regions_hold_every_row():
    pytest.skip('the stream holds one row per lane here (staged lowering), as a loop '
                'holds `buffers` rows: no stream of every row to fall short')
  cfg = _cfg('offload.policy=stride', 'model.n_layers=4', 'offload.subgroup_size=16384',
             'data.seq_len=32', 'data.batch_size=2')
  devices = jax.devices()[:1]
  params = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps,
                               platform=dos_jax.Program.TWO_MEMORIES)
  opt_state = dos_jax.abstract_state(tx, params)
  states = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, dos_jax.OffloadedState)) if isinstance(x, dos_jax.OffloadedState)]
  assert states[0].partition.two_memories
  plan = cfg.offload.placement.plan(states[0].layout.spec())
  assert len(plan.streamed) > plan.buffers
  budget, _ = memory.run_budget(cfg, devices, 1e12)
  model_bytes = 1e12 * (1 - memory.MARGIN) - budget  # params and grads
  tight = (model_bytes + 4e6) / (1 - memory.MARGIN)  # 4 MB beside the model
  line = step_memory.stream_shortfall(cfg, plan, devices, device_bytes=tight)
  assert line is not None and line.startswith('offload.policy=stride:'), line
  assert f'all {len(plan.streamed)} streamed subgroups' in line, line
  assert step_memory.stream_shortfall(cfg, plan, devices, device_bytes=1e12) is None
  assert step_memory.stream_shortfall(cfg, plan, devices, device_bytes=tight,
                                      regions=False) is None
  with pytest.raises(ConfigError, match='offload.policy=stride'):
    optimizer_lib.check_stream_memory(cfg, opt_state, devices, device_bytes=tight)
  optimizer_lib.check_stream_memory(cfg, opt_state, devices, device_bytes=1e12)
