"""The runner's model configuration: `ModelConfig`, the typed `model:` section.

Sizes come from a preset (`dos_jax.model_shapes`) unless given; every field is checked
when the config is built. `dos_jax.train.model` builds the transformer from it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dos_jax import model_shapes
from dos_jax.train.rope import RopeScaling

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
ATTENTION = ('auto', 'xla', 'cudnn')
_SIZE_FIELDS = ('dim', 'ffn_dim', 'n_layers', 'n_heads', 'vocab_size')
# Taken from the preset when None, like the sizes, but optional without one.
_OPTIONAL_SHAPE_FIELDS = ('n_kv_heads', 'tie_embeddings')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and numerics of the transformer.

  A size left as None is taken from `preset`; a size given explicitly overrides it.
  """

  # Name in dos_jax.model_shapes.PRESETS ('tiny', '125m', '7b', ...) supplying unset sizes.
  preset: str | None = None
  # Residual stream width.
  dim: int | None = None
  # Hidden width of the SwiGLU MLP.
  ffn_dim: int | None = None
  # Number of decoder blocks.
  n_layers: int | None = None
  # Attention heads; dim / n_heads is the head width and must be even (rotary pairs).
  n_heads: int | None = None
  # Token vocabulary (embedding rows and output columns); must cover the tokenizer's.
  vocab_size: int | None = None
  # Key/value heads (grouped-query attention); must divide n_heads. None: the preset's,
  # else n_heads (multi-head attention).
  n_kv_heads: int | None = None
  # The output head is the input embedding transposed (no `head` parameter). None: the
  # preset's, else false.
  tie_embeddings: bool | None = None
  # Longest sequence `apply` accepts.
  max_seq_len: int = 256
  # Storage dtype of the parameters: 'float32' or 'bfloat16'.
  param_dtype: str = 'float32'
  # Dtype of activations and matmuls: 'float32' or 'bfloat16'; logits are always float32.
  compute_dtype: str = 'bfloat16'
  # Recompute each block's activations in the backward pass instead of storing them.
  remat: bool = False
  # Attention kernel: 'xla' (scores materialized, float32 softmax: memory ~ L^2 per
  # head), 'cudnn' (cuDNN's fused flash attention, GPU only, bfloat16 compute: memory
  # ~ L), or 'auto' (cudnn on a GPU with bfloat16 compute, else xla).
  attention: str = 'auto'
  # Base of the rotary position frequencies.
  rope_theta: float = 10000.0
  # Llama 3.1's rotary frequency scaling; null: none.
  rope_scaling: RopeScaling | None = None
  # Epsilon added to the mean square in every RMSNorm.
  norm_eps: float = 1e-6
  # A local Hugging Face Llama folder (config.json and *.safetensors) to start from: the
  # sizes and settings above come from its config.json (a size also given here must
  # agree; the preset is dropped) and a fresh run starts from its weights, cast to
  # param_dtype. A resumed run restores its checkpoint instead. See dos_jax.train.hf.
  from_hf: str | None = None

  def __post_init__(self):
    if self.from_hf is not None:
      self._resolve_from_hf()
    if self.preset is not None:
      if not isinstance(self.preset, str) or self.preset not in model_shapes.PRESETS:
        raise ValueError(
            f'ModelConfig.preset: unknown preset {self.preset!r}; '
            f'known: {", ".join(model_shapes.PRESETS)}'
        )
    for name in _SIZE_FIELDS:
      value = getattr(self, name)
      if value is None:
        if self.preset is None:
          raise ValueError(f'ModelConfig.{name} must be set when no preset is given')
      elif not _is_positive_int(value):
        raise ValueError(f'ModelConfig.{name} must be a positive integer, got {value!r}')
    if not _is_positive_int(self.max_seq_len):
      raise ValueError(
          f'ModelConfig.max_seq_len must be a positive integer, got {self.max_seq_len!r}'
      )
    for name in ('param_dtype', 'compute_dtype'):
      value = getattr(self, name)
      if value not in _DTYPES:
        raise ValueError(
            f'ModelConfig.{name} must be one of {", ".join(_DTYPES)}, got {value!r}'
        )
    if self.attention not in ATTENTION:
      raise ValueError(
          f'ModelConfig.attention must be one of {", ".join(ATTENTION)}, got {self.attention!r}'
      )
    if self.attention == 'cudnn' and self.compute_dtype != 'bfloat16':
      raise ValueError(
          "ModelConfig.attention: 'cudnn' needs compute_dtype 'bfloat16' (cuDNN's flash"
          f' attention takes 16-bit inputs), got {self.compute_dtype!r}')
    if not isinstance(self.remat, bool):
      raise ValueError(f'ModelConfig.remat must be true or false, got {self.remat!r}')
    if self.n_kv_heads is not None and not _is_positive_int(self.n_kv_heads):
      raise ValueError(
          f'ModelConfig.n_kv_heads must be a positive integer, got {self.n_kv_heads!r}')
    if self.tie_embeddings is not None and not isinstance(self.tie_embeddings, bool):
      raise ValueError(
          f'ModelConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}')
    for name in ('rope_theta', 'norm_eps'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f'ModelConfig.{name} must be a positive number, got {value!r}')
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
          f'ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}')
    heads = self.n_heads or (model_shapes.PRESETS[self.preset].n_heads if self.preset else 0)
    if self.n_kv_heads is not None and heads and heads % self.n_kv_heads:
      raise ValueError(
          f'ModelConfig.n_kv_heads: {self.n_kv_heads} must divide n_heads ({heads})')
    shape = self.shape()  # Checks the resolved sizes together.
    if shape.head_dim % 2:
      raise ValueError(
          f'ModelConfig: head width dim / n_heads = {shape.dim} / {shape.n_heads} = '
          f'{shape.head_dim} must be even for rotary positions'
      )

  def _resolve_from_hf(self) -> None:
    """Fills the sizes and settings from `from_hf`'s config.json (ValueError naming the
    key that disagrees, or `from_hf` for a folder that is not a Llama checkpoint)."""
    from dos_jax.train import hf_config  # pylint: disable=import-outside-toplevel

    if not isinstance(self.from_hf, str) or not self.from_hf:
      raise ValueError(f'ModelConfig.from_hf must be a folder path, got {self.from_hf!r}')
    settings = hf_config.read(self.from_hf)
    for name in _SIZE_FIELDS + _OPTIONAL_SHAPE_FIELDS:
      given = getattr(self, name)
      if given is not None and given != settings[name]:
        raise ValueError(
            f'ModelConfig.{name}: {given!r} disagrees with {settings[name]!r} in'
            f' {hf_config.config_path(self.from_hf)}; leave it unset or make them agree')
    scaling = settings.pop('rope_scaling')
    object.__setattr__(self, 'rope_scaling', None if scaling is None else RopeScaling(**scaling))
    object.__setattr__(self, 'preset', None)
    for name, value in settings.items():
      object.__setattr__(self, name, value)

  def shape(self) -> model_shapes.ModelShape:
    """The resolved sizes: explicit fields first, then the preset's."""
    base = model_shapes.PRESETS[self.preset] if self.preset is not None else None
    sizes = {}
    for name in _SIZE_FIELDS:
      value = getattr(self, name)
      sizes[name] = getattr(base, name) if value is None else value
    for name in _OPTIONAL_SHAPE_FIELDS:
      value = getattr(self, name)
      if value is None and base is not None:
        value = getattr(base, name)
      if value is not None:
        sizes[name] = value
    try:
      return model_shapes.ModelShape(**sizes)
    except ValueError as e:
      raise ValueError(f'ModelConfig: {e}') from None

  def attention_impl(self, backend: str | None = None) -> str:
    """'xla' or 'cudnn': `attention` with 'auto' resolved for `backend` (a JAX backend
    name; None: `jax.default_backend()`). Code that builds a GPU program on another
    machine passes 'gpu' explicitly."""
    if self.attention != 'auto':
      return self.attention
    backend = jax.default_backend() if backend is None else backend
    on_gpu = backend in ('gpu', 'cuda')
    return 'cudnn' if on_gpu and self.compute_dtype == 'bfloat16' else 'xla'

  @property
  def param_jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(_DTYPES[self.param_dtype])

  @property
  def compute_jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(_DTYPES[self.compute_dtype])


def _is_positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0
