"""Llama 3.1's rotary frequency scaling, as Hugging Face's config.json spells it.

`RopeScaling` is the `model.rope_scaling` section of a run config (and what
`dos_jax.train.hf` reads from a checkpoint's `rope_scaling`); `llama3_scaled` applies it
to the rotary frequencies `dos_jax.train.model.rotary_tables` makes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1's rotary frequency scaling (`rope_scaling` with `rope_type: llama3` in a
  Hugging Face config.json): wavelengths longer than `original_max_position_embeddings /
  low_freq_factor` are stretched by `factor`, those shorter than `... / high_freq_factor`
  kept, and the band between blended smoothly."""

  # The only scaling implemented: 'llama3' (Llama 3.1, 3.2 and 3.3 use it).
  rope_type: Literal['llama3'] = 'llama3'
  # How much the long wavelengths are stretched (8 in Llama 3.1, 32 in Llama 3.2 1B/3B).
  factor: float = 8.0
  # Wavelengths above original_max_position_embeddings / low_freq_factor are scaled.
  low_freq_factor: float = 1.0
  # Wavelengths below original_max_position_embeddings / high_freq_factor are kept.
  high_freq_factor: float = 4.0
  # The context length the model was pretrained at before scaling.
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type != 'llama3':
      raise ValueError(f'rope_type: only \'llama3\' is implemented, got {self.rope_type!r}')
    for name in ('factor', 'low_freq_factor', 'high_freq_factor'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f'{name}: must be a positive number, got {value!r}')
    if not _is_positive_int(self.original_max_position_embeddings):
      raise ValueError('original_max_position_embeddings: must be a positive integer, got'
                       f' {self.original_max_position_embeddings!r}')
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f'high_freq_factor: {self.high_freq_factor} must exceed'
                       f' low_freq_factor ({self.low_freq_factor})')


def llama3_scaled(freq_K2: jax.Array, scaling: RopeScaling) -> jax.Array:
  """Llama 3.1's frequencies: low ones divided by `factor`, high ones kept, a linear
  blend in wavelength-inverse between (Meta's `apply_scaling`, in float32)."""
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen_K2 = 2 * math.pi / freq_K2
  slow_K2 = freq_K2 / scaling.factor
  smooth_K2 = (old_len / wavelen_K2 - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  blended_K2 = (1 - smooth_K2) * slow_K2 + smooth_K2 * freq_K2
  return jnp.where(wavelen_K2 < high_wavelen, freq_K2,
                   jnp.where(wavelen_K2 > low_wavelen, slow_K2, blended_K2))



def _is_positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0
