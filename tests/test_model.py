"""The runner's transformer: shapes, size, a float64 numpy reference, causality, remat, training."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax import model_shapes
from dos_jax.train import model

# Small enough to compile in about a second; head width 8 keeps rotary pairs. (The same
# shapes as test_sharding_rules.CFG, so one pytest process compiles their init once.)
SMALL = model.ModelConfig(
    dim=32, ffn_dim=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16,
    compute_dtype='float32',
)


@pytest.fixture(scope='module')
def small(module_seed):
  """SMALL's jitted forward and parameters, built once for the module."""
  apply, params = model.build_model(SMALL, seed=module_seed)
  return jax.jit(apply), params


def _tokens(seed, batch, length, vocab):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, jnp.int32)


def _num_params(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# ----- a float64 numpy reference written from the Llama recipe, independent of model.py -----


def _np_rmsnorm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_rope(x_BxLxHxK, theta):
  # Pairs (i, i + K/2) as complex numbers, multiplied by exp(i * pos * freq_i).
  half = x_BxLxHxK.shape[-1] // 2
  pos = np.arange(x_BxLxHxK.shape[1])[:, None]
  freq = theta ** (-2.0 * np.arange(half) / x_BxLxHxK.shape[-1])
  rot = np.exp(1j * pos * freq)[None, :, None, :]
  z = (x_BxLxHxK[..., :half] + 1j * x_BxLxHxK[..., half:]) * rot
  return np.concatenate([z.real, z.imag], axis=-1)


def _np_forward(p, tokens, theta):
  """Grouped-query heads: query head h reads key/value head h // (H / G); tied
  embeddings: no 'head', the embedding transposed."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = p['embedding'][np.asarray(tokens)]
  length = x.shape[1]
  causal = np.tril(np.ones((length, length), bool))
  for name in sorted(p['blocks']):
    blk = p['blocks'][name]
    h = _np_rmsnorm(x, blk['attn_norm']['scale'])
    q = _np_rope(np.einsum('bld,dhk->blhk', h, blk['attn']['wq']), theta)
    group = blk['attn']['wq'].shape[1] // blk['attn']['wk'].shape[1]
    k = _np_rope(np.einsum('bld,dhk->blhk', h, blk['attn']['wk']), theta).repeat(group, 2)
    v = np.einsum('bld,dhk->blhk', h, blk['attn']['wv']).repeat(group, 2)
    s = np.einsum('bqhk,bshk->bhqs', q, k) / math.sqrt(q.shape[-1])
    s = np.where(causal, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum('bhqs,bshk->bqhk', w, v)
    x = x + np.einsum('blhk,hkd->bld', o, blk['attn']['wo'])
    h = _np_rmsnorm(x, blk['mlp_norm']['scale'])
    g = h @ blk['mlp']['w_gate']
    x = x + ((g / (1 + np.exp(-g))) * (h @ blk['mlp']['w_up'])) @ blk['mlp']['w_down']
  head = p['head'] if 'head' in p else p['embedding'].T
  return _np_rmsnorm(x, p['final_norm']['scale']) @ head


def test_forward_matches_float64_reference(small, seed):
  apply, params = small
  # Non-trivial norm scales, so a forgotten scale would show.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.1 * jax.random.normal(jax.random.key(len(str(path))), x.shape)
      if str(path[-1]) == "['scale']" else x,
      params,
  )
  tokens = _tokens(seed, 3, 11, SMALL.vocab_size)
  logits = apply(params, tokens)
  assert logits.shape == (3, 11, SMALL.vocab_size) and logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _np_forward(params, tokens, SMALL.rope_theta),
                             rtol=1e-4, atol=1e-5)


def test_gqa_and_tied_forward_match_float64_reference(seed):
  # 4 query heads over 2 key/value heads, output head = embedding^T.
  cfg = dataclasses.replace(SMALL, n_kv_heads=2, tie_embeddings=True)
  apply, params = model.build_model(cfg, seed=seed)
  assert params['blocks']['0']['attn']['wk'].shape == (32, 2, 8) and 'head' not in params
  tokens = _tokens(seed + 1, 2, 13, cfg.vocab_size)
  np.testing.assert_allclose(jax.jit(apply)(params, tokens),
                             _np_forward(params, tokens, cfg.rope_theta), rtol=1e-4, atol=1e-5)


def test_bf16_compute_stays_close_to_float32(small, seed):
  apply32, params = small
  apply16 = jax.jit(model.make_apply(dataclasses.replace(SMALL, compute_dtype='bfloat16')))
  tokens = _tokens(seed, 2, 16, SMALL.vocab_size)
  out32, out16 = apply32(params, tokens), apply16(params, tokens)
  assert out16.dtype == jnp.float32
  # bf16 keeps 8 mantissa bits (unit roundoff 2**-8 of the largest logit, ~0.4 here):
  # measured over six seeds, the largest difference is 0.53 of that bound (1.8e-3 to
  # 2.2e-3), so twice the roundoff of the largest logit holds them with room.
  largest = float(np.abs(out32).max())
  np.testing.assert_allclose(out16, out32, rtol=0, atol=2 * 2.0**-8 * largest)
  assert np.abs(np.asarray(out16) - np.asarray(out32)).max() > 0  # bf16 did compute


@pytest.mark.parametrize('cfg', [
    SMALL,
    model.ModelConfig(preset='tiny'),
    model.ModelConfig(preset='tiny', n_layers=1, vocab_size=300, ffn_dim=100),
    model.ModelConfig(preset='tiny', n_kv_heads=1, tie_embeddings=True),
], ids=['small', 'tiny', 'tiny-overridden', 'tiny-gqa-tied'])
def test_param_count_matches_model_shape(cfg):
  params = jax.eval_shape(lambda: model.init_params(cfg, 0))
  assert _num_params(params) == cfg.shape().num_params()
  assert len(params['blocks']) == cfg.shape().n_layers


@pytest.mark.parametrize('name', ['llama3-8b', 'llama3.2-1b', 'llama3.2-3b'])
def test_llama3_presets_count_what_init_makes(name):
  # (tests/test_hf.py checks these counts against transformers' own models.)
  cfg = model.ModelConfig(preset=name, n_layers=1)
  params = jax.eval_shape(lambda: model.init_params(cfg, 0))
  assert _num_params(params) == cfg.shape().num_params()


def test_preset_fills_only_unset_fields():
  cfg = model.ModelConfig(preset='125m', n_layers=2)
  assert cfg.shape() == dataclasses.replace(model_shapes.PRESETS['125m'], n_layers=2)


def test_block_names_sort_in_layer_order():
  params = jax.eval_shape(
      lambda: model.init_params(dataclasses.replace(SMALL, n_layers=12), 0))
  names = list(params['blocks'])
  assert sorted(names) == [model.block_name(i, 12) for i in range(12)]
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
      jax.tree.map(lambda x: 0, params))


def test_causality(small, seed):
  apply, params = small
  tokens = _tokens(seed, 2, 12, SMALL.vocab_size)
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % SMALL.vocab_size)
  a, b = apply(params, tokens), apply(params, changed)
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
  assert np.all(np.abs(np.asarray(a[:, 7:] - b[:, 7:])).max(axis=-1) > 1e-4)


def test_remat_gives_same_loss_and_grads(small, seed):
  cfg = SMALL
  _, params = small
  apply = model.make_apply(cfg)
  assert cfg.n_layers == 2  # Remat wraps each block; two show that they chain.
  apply_remat = model.make_apply(dataclasses.replace(cfg, remat=True))
  tokens = _tokens(seed, 2, 13, cfg.vocab_size)
  grad = lambda f: jax.jit(jax.value_and_grad(lambda p: model.loss_fn(f, p, tokens)[0]))
  (l0, g0), (l1, g1) = grad(apply)(params), grad(apply_remat)(params)
  # The recomputed forward runs the same float32 ops; only fusion order may differ.
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)


def test_loss_is_mean_cross_entropy(small, seed):
  apply, params = small
  tokens = _tokens(seed, 2, 9, SMALL.vocab_size)
  loss, metrics = jax.jit(lambda p, t: model.loss_fn(apply, p, t))(params, tokens)
  logits = np.asarray(apply(params, tokens[:, :-1]), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  targets = np.asarray(tokens[:, 1:])
  expected = -np.take_along_axis(logp, targets[..., None], -1).mean()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert float(metrics['loss']) == float(loss)
  assert 0.0 <= float(metrics['accuracy']) <= 1.0
  # Fresh weights predict nearly uniformly.
  assert abs(float(loss) - math.log(SMALL.vocab_size)) < 0.2


@pytest.mark.parametrize('param_dtype', ['float32', 'bfloat16'])
def test_adamw_on_a_repeated_batch_reduces_loss(param_dtype, seed):
  # One block: the optimizer loop needs no depth, and compiles in half the time.
  cfg = dataclasses.replace(SMALL, n_layers=1, param_dtype=param_dtype, compute_dtype='bfloat16')
  apply, params = model.build_model(cfg, seed=seed)
  assert all(x.dtype == jnp.dtype(param_dtype) for x in jax.tree.leaves(params))
  opt = optax.adamw(3e-3)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    (loss, _), grads = jax.value_and_grad(model.loss_fn, argnums=1, has_aux=True)(
        apply, params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  tokens = _tokens(seed + 1, 4, 16, cfg.vocab_size)
  losses = []
  for _ in range(25):
    params, opt_state, loss, grads = step(params, opt_state, tokens)
    losses.append(float(loss))
  assert all(g.dtype == jnp.dtype(param_dtype) for g in jax.tree.leaves(grads))
  assert all(x.dtype == jnp.dtype(param_dtype) for x in jax.tree.leaves(params))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.7 * losses[0], losses
  assert step._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.parametrize('kwargs, culprit', [
    (dict(preset='huge'), 'preset'),
    (dict(dim=32, ffn_dim=48, n_layers=2, n_heads=4), 'vocab_size'),
    (dict(preset='tiny', dim=-1), 'dim'),
    (dict(preset='tiny', n_heads=True), 'n_heads'),
    (dict(preset='tiny', param_dtype='float16'), 'param_dtype'),
    (dict(preset='tiny', compute_dtype='fp8'), 'compute_dtype'),
    (dict(preset='tiny', max_seq_len=0), 'max_seq_len'),
    (dict(preset='tiny', remat='yes'), 'remat'),
    (dict(preset='tiny', rope_theta=0.0), 'rope_theta'),
    (dict(preset='tiny', n_heads=3), 'n_heads'),
    (dict(preset='tiny', dim=120, n_heads=8), 'even'),
    (dict(preset='tiny', n_kv_heads=3), 'n_kv_heads'),
    (dict(preset='tiny', n_kv_heads=0), 'n_kv_heads'),
    (dict(preset='tiny', tie_embeddings='yes'), 'tie_embeddings'),
    (dict(preset='tiny', norm_eps=0.0), 'norm_eps'),
])
def test_bad_config_names_the_field(kwargs, culprit):
  with pytest.raises(ValueError, match=culprit):
    model.ModelConfig(**kwargs)


def test_too_long_sequence_is_a_clear_error(small):
  apply, params = small
  with pytest.raises(ValueError, match='max_seq_len=16'):
    apply(params, jnp.zeros((1, 17), jnp.int32))
