"""Hugging Face Llama checkpoints in and out, against transformers' LlamaForCausalLM.

The reference is transformers' own model (torch, CPU, float32): tiny random checkpoints
written by `save_pretrained`, MHA and GQA, tied and untied embeddings, with and without
Llama 3.1 rope scaling, single-file and sharded. Logits on random tokens must agree to
|ours - ref| <= 5e-5 + 1e-5 |ref| (float32; the logits are O(3) with
initializer_range 0.1, where a wrong rope scaling or head grouping moves them by O(1)).
Seeds (torch's for the weights, numpy's for the tokens) are in each case's id.
"""

import json
import os

import jax
import numpy as np
import pytest

from dos_jax import model_shapes
from dos_jax.train import hf, model
from tests import hf_imports

pytestmark = pytest.mark.hf
torch, transformers = hf_imports.import_transformers()

VOCAB = 300
LLAMA3_SCALING = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                  'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}
ATOL, RTOL = 5e-5, 1e-5


def make_reference(folder, *, seed, kv_heads=2, tie=False, scaling=True, shard=None,
                   dtype=None, vocab=VOCAB, layers=2):
  """A random LlamaForCausalLM saved to `folder` (sharded when `shard` is a size); the
  head width is 16, and original_max_position_embeddings 16 puts the rotary frequencies
  in all three bands of the llama3 scaling."""
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
      rope_scaling=dict(LLAMA3_SCALING) if scaling else None, rope_theta=10000.0,
      rms_norm_eps=1e-5, max_position_embeddings=64, initializer_range=0.1)
  ref = transformers.LlamaForCausalLM(config).eval()
  if dtype is not None:
    ref = ref.to(dtype)
  ref.save_pretrained(str(folder), max_shard_size=shard or '5GB')
  return ref


def reference_logits(ref, tokens_BxL):
  with torch.no_grad():
    return ref(torch.tensor(np.asarray(tokens_BxL))).logits.float().numpy()


CASES = {
    # id: (kv_heads, tie, scaling, shard)
    'mha-untied-plain-single-seed0': (4, False, False, None),
    'gqa-untied-llama3-sharded-seed1': (2, False, True, '40KB'),
    'gqa-tied-plain-sharded-seed2': (1, True, False, '40KB'),
    'mha-tied-llama3-single-seed3': (4, True, True, None),
}


@pytest.mark.parametrize('case', list(CASES))
def test_logits_match_transformers(tmp_path, case):
  kv_heads, tie, scaling, shard = CASES[case]
  seed = int(case.rsplit('seed', 1)[1])
  ref = make_reference(tmp_path, seed=seed, kv_heads=kv_heads, tie=tie, scaling=scaling,
                       shard=shard)
  assert os.path.exists(tmp_path / hf.INDEX_JSON) == (shard is not None)
  cfg, params = hf.load(str(tmp_path), compute_dtype='float32')
  shape = cfg.shape()
  assert (shape.kv_heads, shape.tie_embeddings) == (kv_heads, tie)
  assert (cfg.rope_scaling is not None) == scaling and cfg.norm_eps == 1e-5
  tokens = np.random.default_rng(seed).integers(0, VOCAB, (2, 48))
  ours = np.asarray(jax.jit(model.make_apply(cfg))(params, tokens))
  np.testing.assert_allclose(ours, reference_logits(ref, tokens), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('dtype, shard', [('float32', None), ('bfloat16', '40KB')])
def test_export_then_from_pretrained_gives_identical_tensors(tmp_path, dtype, shard):
  ref = make_reference(tmp_path / 'in', seed=4, kv_heads=2, scaling=True,
                       dtype=getattr(torch, dtype))
  cfg, params = hf.load(str(tmp_path / 'in'))
  assert cfg.param_dtype == dtype
  max_shard = 40_000 if shard else hf.MAX_SHARD_BYTES
  hf.save(cfg, params, str(tmp_path / 'out'), max_shard_bytes=max_shard)
  assert os.path.exists(tmp_path / 'out' / hf.INDEX_JSON) == (shard is not None)
  back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / 'out'))
  want, got = ref.state_dict(), back.state_dict()
  assert set(got) == set(want)
  for name, tensor in want.items():
    assert got[name].dtype == tensor.dtype, name
    assert torch.equal(got[name], tensor), name
  assert back.config.rope_scaling['rope_type'] == 'llama3'


def test_runner_places_each_tensor_on_its_own_devices(tmp_path):
  # GQA 4/2 heads over mesh data=4 x tensor=2 (8 virtual CPU devices): the runner's
  # import gives each device its own slice of whole KV groups, equal to hf.load's.
  from dos_jax.train import config, mesh, trainer  # pylint: disable=import-outside-toplevel
  make_reference(tmp_path, seed=6, kv_heads=2)
  _, want = hf.load(str(tmp_path))
  cfg = config.RunConfig(model=model.ModelConfig(from_hf=str(tmp_path)),
                         mesh=config.MeshConfig(data=4, tensor=2))
  params, _ = trainer.hf_params(cfg, mesh.make_mesh(cfg.mesh, jax.devices()[:8]))
  wk = params['blocks']['0']['attn']['wk']
  assert {s.data.shape for s in wk.addressable_shards} == {(64, 1, 16)}
  jax.tree.map(lambda got, host: np.testing.assert_array_equal(np.asarray(got), host),
               params, want)


def test_save_is_atomic_and_refuses_a_used_folder(tmp_path, monkeypatch):
  cfg = model.ModelConfig(preset='tiny', n_kv_heads=2)
  params = model.init_params(cfg, 0)
  (tmp_path / 'taken').mkdir()
  (tmp_path / 'taken' / 'x').write_text('x')
  with pytest.raises(FileExistsError):
    hf.save(cfg, params, str(tmp_path / 'taken'))

  def crash(*args, **kwargs):
    raise KeyboardInterrupt  # As if killed while the second file is written.

  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  real, calls = st_numpy.save_file, []
  monkeypatch.setattr(st_numpy, 'save_file',
                      lambda *a, **k: crash() if calls else calls.append(real(*a, **k)))
  with pytest.raises(KeyboardInterrupt):
    hf.save(cfg, params, str(tmp_path / 'new'), max_shard_bytes=100_000)
  assert sorted(os.listdir(tmp_path)) == ['taken']


def _rewrite(folder, **changes):
  path = folder / 'config.json'
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_bad_checkpoints_are_one_line_errors(tmp_path):
  make_reference(tmp_path / 'a', seed=5)
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  single = tmp_path / 'a' / hf.SINGLE_FILE
  tensors = load_file(str(single))

  def expect(error, *fragments):
    message = str(error.value)
    assert '\n' not in message
    for fragment in fragments:
      assert fragment in message, message

  extra = dict(tensors, **{'model.layers.0.self_attn.q_bias': np.zeros(64, np.float32)})
  save_file(extra, str(single), metadata={'format': 'pt'})
  with pytest.raises(hf.CheckpointError) as err:
    hf.load(str(tmp_path / 'a'))
  expect(err, "unknown tensor 'model.layers.0.self_attn.q_bias'", str(single))

  missing = {k: v for k, v in tensors.items() if k != 'model.layers.1.mlp.up_proj.weight'}
  save_file(missing, str(single), metadata={'format': 'pt'})
  with pytest.raises(hf.CheckpointError) as err:
    hf.load(str(tmp_path / 'a'))
  expect(err, "'model.layers.1.mlp.up_proj.weight' is missing")

  save_file(tensors, str(single), metadata={'format': 'pt'})
  _rewrite(tmp_path / 'a', intermediate_size=128)
  with pytest.raises(hf.CheckpointError) as err:
    hf.load(str(tmp_path / 'a'))
  expect(err, 'model.layers.0.mlp.gate_proj.weight', 'shape (96, 64)', '(128, 64)')

  _rewrite(tmp_path / 'a', intermediate_size=96, architectures=['MistralForCausalLM'])
  with pytest.raises(ValueError) as err:
    hf.load(str(tmp_path / 'a'))
  expect(err, 'from_hf:', "architecture ['MistralForCausalLM'] is not supported")

  _rewrite(tmp_path / 'a', architectures=['LlamaForCausalLM'], hidden_size=None)
  with pytest.raises(ValueError) as err:
    hf.load(str(tmp_path / 'a'))
  expect(err, "missing key 'hidden_size'")


@pytest.mark.parametrize('name', ['llama3-8b', 'llama3.2-1b', 'llama3.2-3b'])
def test_llama3_presets_count_as_transformers(name):
  shape = model_shapes.PRESETS[name]
  config = transformers.LlamaConfig(
      vocab_size=shape.vocab_size, hidden_size=shape.dim, intermediate_size=shape.ffn_dim,
      num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
      num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tie_embeddings)
  with torch.device('meta'):  # Shapes only: no memory for 8B weights.
    reference = transformers.LlamaForCausalLM(config)
  assert shape.num_params() == sum(p.numel() for p in reference.parameters())
