"""Transformer shapes by name: the one place the preset sizes are written down.

Used by the runner (`model.preset` in a run config) and by `dos-jax plan`. Each name is
the preset's parameter count (within 4%; 7b is Llama's 6.74B) for this Llama-style architecture (SwiGLU MLP,
untied embeddings, no grouped-query attention); `tiny` is the CPU default. The `llama3-*`
presets are Meta's published Llama 3 shapes (grouped-query attention with 8 KV heads, the
128256-token vocabulary; 3.2's 1B and 3B tie their embeddings): 8.03B, 1.24B, 3.21B. 7b and 13b
are the Deep Optimizer States paper's shapes (docs/planner.md); its 20b, 30b and 70b shapes
count 17.1B, 32.5B and 78.4B here (the paper's models differ in MLP or attention), so
those presets keep the paper's widths, depths and heads and narrow the MLP until the
count matches the name. 125m and 1.3b keep GPT-2's 50304-token vocabulary, whose untied
embeddings would push GPT-3's widths to 162M and 1.42B: 125m is narrower (640), 1.3b
has a narrower MLP.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The sizes that determine a decoder-only transformer's parameter count.

  Attributes:
    dim: model (residual stream) width.
    ffn_dim: hidden width of the SwiGLU MLP.
    n_layers: number of decoder blocks.
    n_heads: attention heads (head_dim = dim // n_heads).
    vocab_size: embedding rows.
    n_kv_heads: key/value heads (grouped-query attention); None means n_heads (MHA).
    tie_embeddings: the output projection is the input embedding, transposed.
  """

  dim: int
  ffn_dim: int
  n_layers: int
  n_heads: int
  vocab_size: int = 32000
  n_kv_heads: int | None = None
  tie_embeddings: bool = False

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == 'tie_embeddings':
        if not isinstance(value, bool):
          raise ValueError(f'ModelShape.tie_embeddings must be true or false, got {value!r}')
        continue
      if value is None and field.name == 'n_kv_heads':
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'ModelShape.{field.name} must be a positive integer, got {value!r}')
    if self.dim % self.n_heads:
      raise ValueError(
          f'ModelShape.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})'
      )
    if self.n_heads % self.kv_heads:
      raise ValueError(
          f'ModelShape.n_heads ({self.n_heads}) must be divisible by n_kv_heads'
          f' ({self.kv_heads})'
      )

  @property
  def kv_heads(self) -> int:
    """Key/value heads: `n_kv_heads`, or `n_heads` when that is None."""
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  def num_params(self) -> int:
    """Parameters of the Llama-style model: attention (q and output d^2 each, k and v
    d * n_kv_heads * head_dim each: 4 d^2 without GQA), SwiGLU (3 d f), 2 RMSNorms per
    block, a final norm, the input embedding and, unless tied, the output projection."""
    kv_width = self.kv_heads * self.head_dim
    attention = 2 * self.dim * self.dim + 2 * self.dim * kv_width
    per_block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
    embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
    return self.n_layers * per_block + self.dim + embeddings


PRESETS: dict[str, ModelShape] = {
    'tiny': ModelShape(dim=128, ffn_dim=384, n_layers=4, n_heads=4, vocab_size=256),
    '125m': ModelShape(dim=640, ffn_dim=1792, n_layers=12, n_heads=10, vocab_size=50304),
    '1.3b': ModelShape(dim=2048, ffn_dim=4608, n_layers=24, n_heads=16, vocab_size=50304),
    '7b': ModelShape(dim=4096, ffn_dim=11008, n_layers=32, n_heads=32),
    '13b': ModelShape(dim=5120, ffn_dim=13824, n_layers=40, n_heads=40),
    '20b': ModelShape(dim=5120, ffn_dim=25088, n_layers=40, n_heads=64),
    '30b': ModelShape(dim=6656, ffn_dim=15872, n_layers=60, n_heads=52),
    '70b': ModelShape(dim=8192, ffn_dim=24576, n_layers=80, n_heads=64),
    'llama3-8b': ModelShape(dim=4096, ffn_dim=14336, n_layers=32, n_heads=32,
                            vocab_size=128256, n_kv_heads=8),
    'llama3.2-1b': ModelShape(dim=2048, ffn_dim=8192, n_layers=16, n_heads=32,
                              vocab_size=128256, n_kv_heads=8, tie_embeddings=True),
    'llama3.2-3b': ModelShape(dim=3072, ffn_dim=8192, n_layers=28, n_heads=24,
                              vocab_size=128256, n_kv_heads=8, tie_embeddings=True),
}


def preset(name: str) -> ModelShape:
  """Looks up a preset by name, with an error that lists the known names."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(
        f'unknown model preset {name!r}; known: {", ".join(PRESETS)}'
    ) from None
