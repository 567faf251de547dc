"""`model.attention`: 'xla', 'cudnn' (cuDNN's flash attention) or 'auto', and the planner's
activation model for each.

On CPU: the key's validation, how 'auto' resolves per backend, the run config refusing a
bad value with one line, and the activation model against hand counts. On a GPU (`gpu`
marker): the cudnn model's logits and gradients against the XLA attention's, from the
same params and tokens (seeded).
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax.planner import memory
from dos_jax.train import model

MIB = 2**20


@pytest.mark.parametrize('kwargs, culprit', [
    (dict(preset='tiny', attention='flash'), 'attention must be one of auto, xla, cudnn'),
    (dict(preset='tiny', attention='cudnn', compute_dtype='float32'), "'cudnn' needs"),
])
def test_bad_attention_names_the_field(kwargs, culprit):
  with pytest.raises(ValueError, match=culprit):
    model.ModelConfig(**kwargs)


def test_auto_resolves_to_cudnn_on_a_gpu_with_bf16_compute_only():
  auto = model.ModelConfig(preset='tiny')
  assert auto.attention == 'auto'
  assert auto.attention_impl('gpu') == 'cudnn'
  assert auto.attention_impl('cpu') == 'xla'
  assert auto.attention_impl() == 'xla'  # this CPU machine
  fp32 = model.ModelConfig(preset='tiny', compute_dtype='float32')
  assert fp32.attention_impl('gpu') == 'xla'
  assert model.ModelConfig(preset='tiny', attention='xla').attention_impl('gpu') == 'xla'
  assert model.ModelConfig(preset='tiny', attention='cudnn').attention_impl('cpu') == 'cudnn'


def test_the_runner_refuses_an_unknown_attention_with_one_line(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'dos_jax.cli', 'train', '--set', 'model.attention=flash',
       '--set', f'train.out_dir={tmp_path}/run'],
      capture_output=True, text=True, check=False)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and 'model.attention=flash' in lines[0], out.stderr
  assert not (tmp_path / 'run').exists()


def test_cudnn_activations_drop_the_scores():
  # tiny at s=128, b=32 (h=128, f=384, 4 heads, bf16), counted by hand: the stream and
  # MLP as with XLA's attention, 9 x 1 MiB + 3 x 3 MiB, plus the float32 softmax
  # statistics, 4 heads x 128 x 32 x 4 B = 64 KiB, instead of 12 MiB of scores.
  shape = model.ModelConfig(preset='tiny').shape()
  kw = dict(seq_len=128, micro_batch=32)
  per_layer = (9 + 9) * MIB + 4 * 128 * 32 * 4
  assert memory.layer_activation_bytes(shape, **kw, attention='cudnn') == per_layer
  assert memory.layer_activation_bytes(shape, **kw) == (9 + 9 + 8 + 4) * MIB
  # No score gradient at the start of the backward pass, but the last layer's dq, dk,
  # dv (bf16, 3 x 1 MiB) and dq, dk through the rotary in float32 (2 x 2 MiB); the
  # logits and their gradient as before (8 MiB).
  assert memory.activation_bytes(shape, **kw, attention='cudnn') == (
      4 * per_layer + 7 * MIB + 8 * MIB)
  assert memory.activation_bytes(shape, **kw, attention='cudnn', remat=True) == (
      4 * MIB + per_layer + 7 * MIB + 8 * MIB)
  with pytest.raises(ValueError, match='attention'):
    memory.activation_bytes(shape, **kw, attention='auto')


def test_flash_attention_makes_the_papers_20b_activations_linear_in_the_sequence():
  shape = model.ModelConfig(preset='20b').shape()
  xla = [memory.activation_bytes(shape, seq_len=s, micro_batch=1) for s in (1024, 2048)]
  cudnn = [memory.activation_bytes(shape, seq_len=s, micro_batch=1, attention='cudnn')
           for s in (1024, 2048)]
  assert cudnn[1] == pytest.approx(2 * cudnn[0])
  assert xla[1] > 3 * xla[0]  # the s^2 scores dominate
  assert cudnn[1] < 20 * 2**30 < xla[1]


@pytest.mark.gpu
@pytest.mark.parametrize('seed', [0, 1])
def test_cudnn_attention_matches_xla_on_gpu(seed):
  """The tiny model with cuDNN's flash attention against the same model with XLA's, in
  bf16 compute: logits within 2e-2 and gradients within 5% of their norm."""
  cfg = model.ModelConfig(preset='tiny', attention='xla', max_seq_len=256)
  apply_xla, params = model.build_model(cfg, seed)
  apply_cudnn = model.make_apply(model.ModelConfig(preset='tiny', attention='cudnn',
                                                   max_seq_len=256))
  tokens = jax.random.randint(jax.random.key(seed), (4, 257), 0, cfg.shape().vocab_size)

  def loss(apply, p):
    return model.loss_fn(apply, p, tokens)[0]

  logits = [jax.jit(a)(params, tokens[:, :-1]) for a in (apply_xla, apply_cudnn)]
  np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), atol=2e-2)
  grads = [jax.jit(jax.grad(lambda p, a=a: loss(a, p)))(params) for a in (apply_xla, apply_cudnn)]
  diff = jax.tree.map(lambda a, b: jnp.linalg.norm((a - b).astype(jnp.float32)), *grads)
  norm = jax.tree.map(lambda a: jnp.linalg.norm(a.astype(jnp.float32)), grads[0])
  for d, n in zip(jax.tree.leaves(diff), jax.tree.leaves(norm)):
    assert float(d) <= 0.05 * float(n) + 1e-6
  hlo = jax.jit(apply_cudnn).lower(params, tokens[:, :-1]).as_text()
  assert 'cudnn' in hlo.lower()
