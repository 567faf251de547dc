"""The decoder-only transformer the runner trains: Llama-style, written in Flax NNX.

RMSNorm before attention and MLP, rotary positions (optionally with Llama 3.1's frequency
scaling), SwiGLU MLP, causal attention with grouped-query heads (`n_kv_heads`), an output
head untied or tied to the embedding: the Llama family, so that Hugging Face Llama
checkpoints load into it (`dos_jax.train.hf`). Parameters are stored in `param_dtype`;
every matmul runs in `compute_dtype` and the logits come out in float32 so the loss is
always computed in full precision.

The rest of the runner never sees a Flax module: `build_model` returns a pure
`apply(params, tokens)` function and the parameters as a plain nested dict, which is the
pytree `dos_jax` offloads, `sharding.param_specs` shards and orbax checkpoints.

Arrays are named by shape: B batch, L sequence length, D model width, H heads,
K head width, G key/value heads, F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from dos_jax import model_shapes
from dos_jax.train import sharding
from dos_jax.train.model_config import ModelConfig as ModelConfig
from dos_jax.train.rope import RopeScaling, llama3_scaled

Params = dict[str, Any]
ApplyFn = Callable[[Params, jax.Array], jax.Array]

_INIT_STD = 0.02


def _param(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
  # Drawn in float32 then cast, so bf16 and fp32 models from one seed start from the
  # same values up to rounding.
  value = std * jax.random.normal(key, shape, jnp.float32)
  return nnx.Param(value.astype(dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square norm with a learned per-channel scale; statistics in float32."""

  def __init__(self, dim: int, *, param_dtype, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x32_BxLxD = x_BxLxD.astype(jnp.float32)
    ms_BxLx1 = jnp.mean(jnp.square(x32_BxLxD), axis=-1, keepdims=True)
    y_BxLxD = x32_BxLxD * jax.lax.rsqrt(ms_BxLx1 + self.eps)
    return (y_BxLxD * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
  """sin and cos of position * frequency, each (L, K/2), in float32."""
  freq_K2 = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is not None:
    freq_K2 = llama3_scaled(freq_K2, scaling)
  angle_LxK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freq_K2[None, :]
  return jnp.sin(angle_LxK2), jnp.cos(angle_LxK2)


def apply_rotary(x_BxLxHxK: jax.Array, sin_LxK2: jax.Array, cos_LxK2: jax.Array) -> jax.Array:
  """Rotates channel pairs (i, i + K/2) by position-dependent angles (the Llama/NeoX layout)."""
  half = x_BxLxHxK.shape[-1] // 2
  x32 = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  sin, cos = sin_LxK2[None, :, None, :], cos_LxK2[None, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


class CausalSelfAttention(nnx.Module):
  """Causal self-attention with grouped-query heads: the q kernel is (D, H, K), the k and
  v kernels (D, G, K), and query head h reads key/value head h // (H / G) (Hugging Face's
  order), so splitting H and G alike over devices keeps whole groups together."""

  def __init__(self, shape: model_shapes.ModelShape, *, param_dtype, compute_dtype,
               out_std: float, rngs: nnx.Rngs, attention: str = 'xla'):
    d, h, g, k = shape.dim, shape.n_heads, shape.kv_heads, shape.head_dim
    self.wq = _param(rngs.params(), (d, h, k), _INIT_STD, param_dtype)
    self.wk = _param(rngs.params(), (d, g, k), _INIT_STD, param_dtype)
    self.wv = _param(rngs.params(), (d, g, k), _INIT_STD, param_dtype)
    self.wo = _param(rngs.params(), (h, k, d), out_std, param_dtype)
    self.compute_dtype = compute_dtype
    self.attention = attention

  def __call__(self, x_BxLxD, sin_LxK2, cos_LxK2):
    dt = self.compute_dtype
    q_BxLxHxK = jnp.einsum('bld,dhk->blhk', x_BxLxD, self.wq[...].astype(dt))
    k_BxLxGxK = jnp.einsum('bld,dgk->blgk', x_BxLxD, self.wk[...].astype(dt))
    v_BxLxGxK = jnp.einsum('bld,dgk->blgk', x_BxLxD, self.wv[...].astype(dt))
    q_BxLxHxK = apply_rotary(q_BxLxHxK, sin_LxK2, cos_LxK2)
    k_BxLxGxK = apply_rotary(k_BxLxGxK, sin_LxK2, cos_LxK2)
    if self.attention == 'cudnn':
      q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = _sharded_alike(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)
    # 'xla': scores and softmax in float32 whatever the input dtype, all L x L of them
    # kept for the backward pass. 'cudnn': the fused flash kernel keeps only the output
    # and the softmax statistics (float32, L per head). Both take G < H key/value heads
    # themselves (grouped-query attention).
    out_BxLxHxK = jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True, implementation=self.attention)
    return jnp.einsum('blhk,hkd->bld', out_BxLxHxK, self.wo[...].astype(dt))


def _sharded_alike(*xs_BxLxHxK: jax.Array) -> tuple[jax.Array, ...]:
  """q, k and v pinned to one sharding (batch over the data axes, heads over `tensor`)
  of the runner's mesh in context (`make_apply(cfg, mesh)`): cuDNN's attention
  partitions only when the three are sharded alike, which XLA's propagation does not
  promise (with fsdp it does not give it). No mesh in context (or inside a shard_map's
  manual axes): left to XLA."""
  return _constrain(xs_BxLxHxK, lambda batch, tensor: (batch, None, tensor, None))


def _stream(batch, tensor):
  """(B, L, D) pinned batch-split, the width whole (Megatron keeps the stream whole)."""
  del tensor
  return (batch, None, None)


def _columns(batch, tensor):
  """(B, L, F) or (B, L, V) pinned batch-split, the last dimension over `tensor`."""
  return (batch, None, tensor)


def _constrain(xs, spec_of) -> tuple[jax.Array, ...]:
  mesh = jax.sharding.get_abstract_mesh()
  manual = getattr(jax.sharding.AxisType, 'Manual', None)
  if mesh.empty or any(t == manual for t in mesh.axis_types):
    return tuple(xs)
  names = mesh.axis_names
  batch = tuple(a for a in (sharding.DATA, sharding.FSDP) if a in names) or None
  tensor = sharding.TENSOR if sharding.TENSOR in names else None
  spec = jax.sharding.PartitionSpec(*spec_of(batch, tensor))
  return tuple(jax.lax.with_sharding_constraint(x, spec) for x in xs)


class SwiGLU(nnx.Module):
  """Gated MLP: down(silu(gate(x)) * up(x))."""

  def __init__(self, shape: model_shapes.ModelShape, *, param_dtype, compute_dtype,
               out_std: float, rngs: nnx.Rngs):
    d, f = shape.dim, shape.ffn_dim
    self.w_gate = _param(rngs.params(), (d, f), _INIT_STD, param_dtype)
    self.w_up = _param(rngs.params(), (d, f), _INIT_STD, param_dtype)
    self.w_down = _param(rngs.params(), (f, d), out_std, param_dtype)
    self.compute_dtype = compute_dtype

  def __call__(self, x_BxLxD):
    dt = self.compute_dtype
    gate_BxLxF = jnp.einsum('bld,df->blf', x_BxLxD, self.w_gate[...].astype(dt))
    up_BxLxF = jnp.einsum('bld,df->blf', x_BxLxD, self.w_up[...].astype(dt))
    gate_BxLxF, up_BxLxF = _constrain((gate_BxLxF, up_BxLxF), _columns)
    h_BxLxF = jax.nn.silu(gate_BxLxF) * up_BxLxF
    return jnp.einsum('blf,fd->bld', h_BxLxF, self.w_down[...].astype(dt))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, shape, *, param_dtype, compute_dtype, rngs: nnx.Rngs, norm_eps: float,
               attention: str = 'xla'):
    # Residual-branch outputs start smaller with depth (GPT-2), keeping the stream's scale.
    out_std = _INIT_STD / (2 * shape.n_layers) ** 0.5
    kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, out_std=out_std, rngs=rngs)
    self.attn_norm = RMSNorm(shape.dim, param_dtype=param_dtype, eps=norm_eps)
    self.attn = CausalSelfAttention(shape, **kw, attention=attention)
    self.mlp_norm = RMSNorm(shape.dim, param_dtype=param_dtype, eps=norm_eps)
    self.mlp = SwiGLU(shape, **kw)

  def __call__(self, x_BxLxD, sin_LxK2, cos_LxK2):
    # The stream pinned batch-split (and SwiGLU's hidden layer): left to itself,
    # XLA's partitioner gathers whole-batch activations under ZeRO-3 for some layers to
    # compute a slice of a weight's gradient, instead of reduce-scattering the gradient
    # (RESULTS.md "memory-zero3-activations").
    x_BxLxD, = _constrain((x_BxLxD,), _stream)
    x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), sin_LxK2, cos_LxK2)
    return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


def _run_block(block: Block, x_BxLxD, sin_LxK2, cos_LxK2):
  return block(x_BxLxD, sin_LxK2, cos_LxK2)


def block_name(index: int, n_layers: int) -> str:
  """Zero-padded so that sorted dict keys (as in JAX pytrees) follow layer order."""
  return f'{index:0{len(str(n_layers - 1))}d}'


class Transformer(nnx.Module):
  """Embedding, `n_layers` blocks, final norm, head (untied, or the embedding transposed
  when tied); tokens (B, L) -> logits (B, L, V)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    shape = cfg.shape()
    pdt, cdt = cfg.param_jnp_dtype, cfg.compute_jnp_dtype
    self.embedding = _param(rngs.params(), (shape.vocab_size, shape.dim), _INIT_STD, pdt)
    # Layers are kept unrolled, one dict entry each, so that every layer is its own set of
    # leaves: gradients then arrive layer by layer, which the offloaded update exploits.
    attention = cfg.attention_impl()
    self.blocks = nnx.Dict({
        block_name(i, shape.n_layers): Block(shape, param_dtype=pdt, compute_dtype=cdt,
                                             rngs=rngs, norm_eps=float(cfg.norm_eps),
                                             attention=attention)
        for i in range(shape.n_layers)
    })
    self.final_norm = RMSNorm(shape.dim, param_dtype=pdt, eps=float(cfg.norm_eps))
    if not shape.tie_embeddings:
      self.head = _param(rngs.params(), (shape.dim, shape.vocab_size), _INIT_STD, pdt)
    self.tie_embeddings = shape.tie_embeddings
    self.n_layers = shape.n_layers
    self.head_dim = shape.head_dim
    self.max_seq_len = cfg.max_seq_len
    self.rope_theta = float(cfg.rope_theta)
    self.rope_scaling = cfg.rope_scaling
    self.remat = cfg.remat
    self.compute_dtype = cdt

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    if tokens_BxL.ndim != 2:
      raise ValueError(f'tokens must be (batch, length), got shape {tokens_BxL.shape}')
    seq_len = tokens_BxL.shape[1]
    if seq_len > self.max_seq_len:
      raise ValueError(
          f'sequence length {seq_len} exceeds ModelConfig.max_seq_len={self.max_seq_len}'
      )
    sin_LxK2, cos_LxK2 = rotary_tables(seq_len, self.head_dim, self.rope_theta,
                                       self.rope_scaling)
    x_BxLxD = embed(self.embedding[...], tokens_BxL, self.compute_dtype)
    run = nnx.remat(_run_block) if self.remat else _run_block
    for i in range(self.n_layers):
      x_BxLxD = run(self.blocks[block_name(i, self.n_layers)], x_BxLxD, sin_LxK2, cos_LxK2)
    head_DxV = self.embedding[...].T if self.tie_embeddings else self.head[...]
    x_BxLxD, = _constrain((self.final_norm(x_BxLxD),), _stream)
    logits_BxLxV, = _constrain((logits(head_DxV, x_BxLxD, self.compute_dtype),), _columns)
    return logits_BxLxV


def embed(embedding_VxD: jax.Array, tokens_BxL: jax.Array, compute_dtype) -> jax.Array:
  """The input embedding: rows of `embedding` looked up, in the compute dtype."""
  return jnp.take(embedding_VxD, tokens_BxL, axis=0).astype(compute_dtype)


def logits(head_DxV: jax.Array, x_BxLxD: jax.Array, compute_dtype) -> jax.Array:
  """The output head on the final-normed stream."""
  # Logits accumulate in float32 even from bf16 inputs: the softmax over V needs it.
  return jnp.einsum(
      'bld,dv->blv', x_BxLxD, head_DxV.astype(compute_dtype),
      preferred_element_type=jnp.float32,
  )


def init_params(cfg: ModelConfig, seed: int | jax.Array) -> Params:
  """Fresh parameters as a nested dict; jittable (cfg static) to create them sharded."""
  model = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(seed)))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def make_apply(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> ApplyFn:
  """The pure forward function `apply(params, tokens_BxL int) -> logits_BxLxV float32`;
  traced with `mesh` in context when given (cuDNN's attention is then sharded on it)."""
  graphdef, _ = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(0))))
  )

  def apply(params: Params, tokens_BxL: jax.Array) -> jax.Array:
    if mesh is None:
      return nnx.merge(graphdef, params)(tokens_BxL)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return nnx.merge(graphdef, params)(tokens_BxL)

  return apply


@dataclasses.dataclass(frozen=True)
class Parts:
  """The forward pass in pieces, as pure functions of the params' subtrees, for a
  pipeline that runs the blocks on their stages and the rest around them. Composed as
  `head(p, blocks(embed(p, tokens)))` they compute exactly `make_apply(cfg)`."""

  # (embedding VxD, tokens BxL) -> stream BxLxD in the compute dtype.
  embed: Callable[[jax.Array, jax.Array], jax.Array]
  # (one block's params, stream BxLxD, sin LxK/2, cos LxK/2) -> stream BxLxD.
  block: Callable[..., jax.Array]
  # ({'final_norm', 'head'} params, stream BxLxD) -> float32 logits BxLxV (untied only:
  # RunConfig refuses a pipelined run with tied embeddings).
  head: Callable[[Params, jax.Array], jax.Array]
  # seq_len -> (sin, cos) rotary tables.
  rotary: Callable[[int], tuple[jax.Array, jax.Array]]


def make_parts(cfg: ModelConfig) -> Parts:
  """`Parts` of the transformer `cfg` describes (remat applied to each block if set)."""
  shape = cfg.shape()
  pdt, cdt = cfg.param_jnp_dtype, cfg.compute_jnp_dtype
  rngs = lambda: nnx.Rngs(params=jax.random.key(0))
  eps = float(cfg.norm_eps)
  block_def, _ = nnx.split(nnx.eval_shape(
      lambda: Block(shape, param_dtype=pdt, compute_dtype=cdt, rngs=rngs(), norm_eps=eps,
                    attention=cfg.attention_impl())))
  norm_def, _ = nnx.split(nnx.eval_shape(lambda: RMSNorm(shape.dim, param_dtype=pdt, eps=eps)))

  def block(params, x_BxLxD, sin_LxK2, cos_LxK2):
    return nnx.merge(block_def, params)(x_BxLxD, sin_LxK2, cos_LxK2)

  def head(params, x_BxLxD):
    return logits(params['head'], nnx.merge(norm_def, params['final_norm'])(x_BxLxD), cdt)

  return Parts(
      embed=lambda embedding, tokens: embed(embedding, tokens, cdt),
      block=jax.checkpoint(block) if cfg.remat else block,
      head=head,
      rotary=lambda seq_len: rotary_tables(seq_len, shape.head_dim, float(cfg.rope_theta),
                                           cfg.rope_scaling),
  )


def build_model(cfg: ModelConfig, seed: int) -> tuple[ApplyFn, Params]:
  """The forward function and freshly initialised parameters (in `cfg.param_dtype`)."""
  return make_apply(cfg), init_params(cfg, seed)


def loss_fn(
    apply: ApplyFn, params: Params, tokens_BxLp1: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy over all B * L positions of a (B, L + 1) token window.

  Returns:
    (loss, metrics): the float32 loss and {'loss', 'accuracy'} (next-token top-1).
  """
  inputs_BxL, targets_BxL = tokens_BxLp1[:, :-1], tokens_BxLp1[:, 1:]
  logits_BxLxV = apply(params, inputs_BxL)
  losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)
  loss = jnp.mean(losses_BxL)
  accuracy = jnp.mean((jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32))
  return loss, {'loss': loss, 'accuracy': accuracy}
