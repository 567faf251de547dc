"""The sharding table: every parameter gets a spec, and a sharded model computes what an
unsharded one does (8 virtual CPU devices from tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dos_jax.train import model
from dos_jax.train import sharding

# Every split size divides evenly over tensor=4: 4 heads, F=64, V=64.
CFG = model.ModelConfig(
    dim=32, ffn_dim=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16,
    param_dtype='float32', compute_dtype='float32',
)


@pytest.fixture(scope='module')
def built(module_seed):
  return model.build_model(CFG, seed=module_seed)


def _mesh(data, tensor):
  devices = np.array(jax.devices()[: data * tensor]).reshape(data, tensor, 1)
  return Mesh(devices, sharding.MESH_AXES)


def test_every_parameter_gets_the_megatron_spec(built):
  _, params = built
  specs = sharding.param_specs(params)
  assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
      params)
  block = specs['blocks']['0']
  assert block['attn']['wq'] == P(None, 'tensor', None)
  assert block['attn']['wk'] == P(None, 'tensor', None)
  assert block['attn']['wv'] == P(None, 'tensor', None)
  assert block['attn']['wo'] == P('tensor', None, None)
  assert block['mlp']['w_gate'] == P(None, 'tensor')
  assert block['mlp']['w_up'] == P(None, 'tensor')
  assert block['mlp']['w_down'] == P('tensor', None)
  assert block['attn_norm']['scale'] == P(None)
  assert specs['final_norm']['scale'] == P(None)
  assert specs['embedding'] == P('tensor', None)
  assert specs['head'] == P(None, 'tensor')
  assert sharding.batch_spec() == P('data', None)


def test_specs_work_on_abstract_params():
  abstract = jax.eval_shape(lambda: model.init_params(CFG, 0))
  assert sharding.param_specs(abstract)['blocks']['1']['attn']['wo'] == P('tensor', None, None)


def test_replicated_rules_split_nothing(built):
  _, params = built
  specs = sharding.param_specs(params, sharding.ShardingRules.replicated())
  for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    assert all(axis is None for axis in spec)


def test_unknown_parameter_is_named():
  params = {'blocks': {'0': {'attn': {'wq': jnp.zeros((4, 2, 2)), 'bias': jnp.zeros((4,))}}}}
  with pytest.raises(ValueError, match="'blocks/0/attn/bias'"):
    sharding.param_specs(params)


def test_rank_mismatch_is_named():
  with pytest.raises(ValueError, match="'blocks/3/mlp/w_up' has shape \\(4, 2, 2\\)"):
    sharding.param_specs({'blocks': {'3': {'mlp': {'w_up': jnp.zeros((4, 2, 2))}}}})


def test_uneven_split_is_named(built):
  _, params = built
  mesh = _mesh(1, 8)  # 4 heads cannot split 8 ways.
  with pytest.raises(ValueError, match="'blocks/0/attn/wk' dimension 1 of size 4"):
    sharding.param_shardings(params, mesh)


@pytest.mark.parametrize('data, tensor', [(2, 4), (2, 2)])
def test_sharded_forward_matches_unsharded(built, data, tensor):
  apply, params = built
  tokens = jax.random.randint(jax.random.key(data * tensor), (4, 16), 0, CFG.vocab_size)
  expected = jax.jit(apply)(params, tokens)

  mesh = _mesh(data, tensor)
  shardings = sharding.param_shardings(params, mesh)
  sharded_params = jax.device_put(params, shardings)
  sharded_tokens = jax.device_put(tokens, NamedSharding(mesh, sharding.batch_spec()))
  # The split is real: each device holds 1/tensor of the heads and of the vocabulary.
  wq = sharded_params['blocks']['0']['attn']['wq']
  assert wq.addressable_shards[0].data.shape == (CFG.dim, CFG.n_heads // tensor, 8)
  head = sharded_params['head']
  assert head.addressable_shards[0].data.shape == (CFG.dim, CFG.vocab_size // tensor)

  got = jax.jit(apply)(sharded_params, sharded_tokens)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gqa_and_tied_split_by_whole_kv_groups(seed):
  # 8 query heads over 4 key/value heads, tensor=2 (data=2): each device holds 2 whole
  # groups, i.e. 4 query heads and their 2 key/value heads; the tied embedding is split
  # over the vocabulary.
  cfg = model.ModelConfig(dim=64, ffn_dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
                          tie_embeddings=True, vocab_size=64, max_seq_len=16,
                          param_dtype='float32', compute_dtype='float32')
  apply, params = model.build_model(cfg, seed=seed)
  tokens = jax.random.randint(jax.random.key(seed + 1), (4, 16), 0, cfg.vocab_size)
  expected = jax.jit(apply)(params, tokens)
  mesh = _mesh(2, 2)
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  attn = sharded['blocks']['0']['attn']
  assert attn['wq'].addressable_shards[0].data.shape == (64, 4, 8)
  assert attn['wk'].addressable_shards[0].data.shape == (64, 2, 8)
  got = jax.jit(apply)(sharded, jax.device_put(tokens, NamedSharding(mesh, sharding.batch_spec())))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="'blocks/0/attn/wk' dimension 1 of size 4"):
    sharding.param_shardings(params, _mesh(1, 8))  # 4 KV heads cannot split 8 ways.


def test_sharded_gradients_match_unsharded(built, seed):
  apply, params = built
  tokens = jax.random.randint(jax.random.key(seed), (4, 17), 0, CFG.vocab_size)
  grad_fn = jax.jit(jax.grad(lambda p, t: model.loss_fn(apply, p, t)[0]))
  expected = grad_fn(params, tokens)

  mesh = _mesh(2, 2)
  shardings = sharding.param_shardings(params, mesh)
  got = grad_fn(jax.device_put(params, shardings),
                jax.device_put(tokens, NamedSharding(mesh, sharding.batch_spec())))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got,
               expected)


def test_params_initialised_sharded_equal_the_unsharded_ones(built, module_seed):
  """`init_params` under jit with out_shardings (how large models start, each device
  making only its own slices) draws the same values as on one device."""
  _, params = built  # drawn from module_seed
  mesh = _mesh(2, 4)
  abstract = jax.eval_shape(lambda: model.init_params(CFG, module_seed))
  init = jax.jit(model.init_params, static_argnums=0,
                 out_shardings=sharding.param_shardings(abstract, mesh))
  sharded = init(CFG, module_seed)
  assert sharded['head'].sharding.spec == P(None, 'tensor')
  # Same random bits; XLA may fold `std *` into the jitted normal's own scaling, so values
  # can differ from eager ones in the last bit (a different draw would differ by O(std)).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), sharded, params)
