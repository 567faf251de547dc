"""The runner's ZeRO-3 step (fsdp=4, cuDNN attention) compiled for 4 H100s with no GPU,
from abstract arguments (`gpu_program.compile_sharded_step`), against the planner's
`step_memory.predict_step(cfg, devices=4)`.

Needs the CUDA plugin (Python 3.12, jax[cuda13]) and JAX_PLATFORMS=cpu; skipped elsewhere.
"""

import jax
import pytest

from dos_jax import dataflow
from dos_jax.planner import step_memory
from dos_jax.train import config as config_lib

pytestmark = pytest.mark.compiled_gpu

OVERRIDES = ['mesh.data=1', 'mesh.fsdp=4', 'model.param_dtype=bfloat16',
             'model.attention=cudnn', 'offload.subgroup_size=65536', 'optim.clip_norm=1.0']


def _compiled(cfg):
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}')
  if jax.default_backend() != 'cpu' or jax.device_count() < 4:
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu and 4 CPU devices')
  from dos_jax.train import gpu_program  # pylint: disable=import-outside-toplevel
  return gpu_program.compile_sharded_step(cfg, jax.devices()[:4], 'h100_sxm')


@pytest.fixture(scope='module')
def tiny_fsdp4():
  cfg = config_lib.load(None, OVERRIDES)
  return cfg, _compiled(cfg)


def test_the_zero3_step_compiles_for_4_h100s_with_cudnn_attention(tiny_fsdp4):
  _, program = tiny_fsdp4
  text = program.hlo_text
  assert '__cudnn$fmhaSoftmax' in text and '__cudnn$fmhaSoftmaxBackward' in text
  # ZeRO-3: the matrices are gathered and their gradients reduce-scattered by XLA.
  assert 'all-gather' in text and 'reduce-scatter' in text
  # The state stays in pinned host memory, a quarter on each GPU's host side.
  assert program.memory.host_argument_bytes > 0


@pytest.mark.xfail(strict=True, reason=(
    'the planner counts ZeRO-3 activations as batch-sharded; XLA makes some einsums over'
    ' the whole batch with partial sums over the fsdp-split width (full-batch logits,'
    ' all-to-alls around the attention): 21% more than predicted here, 39% at 20B'
    ' (RESULTS.md, issue 29 item 5)'))
def test_the_prediction_is_within_10_percent_under_fsdp(tiny_fsdp4):
  cfg, program = tiny_fsdp4
  predicted = step_memory.predict_step(cfg, devices=4)
  assert predicted.device_bytes == pytest.approx(program.memory.device_peak_bytes, rel=0.10)
