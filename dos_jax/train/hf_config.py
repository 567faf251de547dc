"""A Hugging Face Llama `config.json`, read into `ModelConfig` settings and written back.

`read(folder)` is what `model.from_hf` runs when a run config is loaded: it checks that
the folder holds a `LlamaForCausalLM` this runner's model can hold, and returns the
sizes and settings as `ModelConfig` field values. `to_json(cfg)` is its inverse, for
`dos_jax.train.hf.save`. Both spellings of the rotary settings are read: the published
Llama checkpoints' `rope_theta` + `rope_scaling`, and transformers 5's
`rope_parameters`; the old one is written, which every version of transformers reads.

Errors are ValueErrors whose message starts with the `ModelConfig` field at fault
(`from_hf: DIR/config.json: ...`), so a run config names `model.from_hf`.
"""

from __future__ import annotations

import json
import os
from typing import Any

CONFIG_JSON = 'config.json'
ARCHITECTURE = 'LlamaForCausalLM'

# ModelConfig field <- config.json key, for the sizes that must be present.
_SIZES = {
    'dim': 'hidden_size',
    'ffn_dim': 'intermediate_size',
    'n_layers': 'num_hidden_layers',
    'n_heads': 'num_attention_heads',
    'vocab_size': 'vocab_size',
}
# Settings this model does not have, and the only value it accepts for each.
_FIXED = {'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False}
_LLAMA3_KEYS = ('factor', 'low_freq_factor', 'high_freq_factor',
                'original_max_position_embeddings')


def config_path(folder: str) -> str:
  return os.path.join(folder, CONFIG_JSON)


def read(folder: str) -> dict[str, Any]:
  """ModelConfig field values from `folder`/config.json.

  Returns:
    {'dim', 'ffn_dim', 'n_layers', 'n_heads', 'vocab_size', 'n_kv_heads',
    'tie_embeddings', 'rope_theta', 'norm_eps', 'rope_scaling'}; `rope_scaling` is a
    dict of `RopeScaling` fields or None.

  Raises:
    ValueError: `from_hf: PATH: ...` for a missing or unreadable file, an architecture
      other than LlamaForCausalLM, a missing key or a setting the model does not have.
  """
  path = config_path(folder)
  fail = lambda why: ValueError(f'from_hf: {path}: {why}')
  if not os.path.isdir(folder):
    raise ValueError(f'from_hf: {folder}: no such folder (expected a Hugging Face Llama'
                     ' checkpoint: config.json and *.safetensors)')
  try:
    with open(path, encoding='utf-8') as f:
      raw = json.load(f)
  except FileNotFoundError:
    raise fail('no such file (expected a Hugging Face Llama checkpoint folder)') from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise fail(f'cannot read it as JSON ({type(err).__name__})') from None
  if not isinstance(raw, dict):
    raise fail('expected a JSON object')
  architectures = raw.get('architectures') or (
      [ARCHITECTURE] if raw.get('model_type') == 'llama' else None)
  if architectures != [ARCHITECTURE]:
    shown = architectures if architectures is not None else raw.get('model_type')
    raise fail(f'architecture {shown!r} is not supported (only {ARCHITECTURE})')

  def integer(key: str, default: Any = None) -> int:
    value = raw.get(key, default)
    if value is None:
      raise fail(f'missing key {key!r}')
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise fail(f'{key}: expected a positive integer, got {value!r}')
    return value

  def number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise fail(f'{key}: expected a positive number, got {value!r}')
    return float(value)

  out: dict[str, Any] = {name: integer(key) for name, key in _SIZES.items()}
  out['n_kv_heads'] = integer('num_key_value_heads', out['n_heads'])
  for key, want in _FIXED.items():
    if raw.get(key, want) != want:
      raise fail(f'{key}: {raw[key]!r} is not supported (only {want!r})')
  if out['dim'] % out['n_heads']:
    raise fail(f'hidden_size {out["dim"]} is not divisible by num_attention_heads'
               f' {out["n_heads"]}')
  head_dim = raw.get('head_dim')
  if head_dim is not None and head_dim != out['dim'] // out['n_heads']:
    raise fail(f'head_dim: {head_dim!r} is not supported (only hidden_size /'
               f' num_attention_heads = {out["dim"] // out["n_heads"]})')
  tie = raw.get('tie_word_embeddings', False)
  if not isinstance(tie, bool):
    raise fail(f'tie_word_embeddings: expected true or false, got {tie!r}')
  out['tie_embeddings'] = tie
  out['norm_eps'] = number('rms_norm_eps', raw.get('rms_norm_eps', 1e-6))
  rope = raw.get('rope_parameters')
  if rope is None:
    rope = dict(raw.get('rope_scaling') or {}, rope_theta=raw.get('rope_theta', 10000.0))
  if not isinstance(rope, dict):
    raise fail(f'rope_parameters: expected an object, got {rope!r}')
  out['rope_theta'] = number('rope_theta', rope.get('rope_theta', 10000.0))
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind == 'default':
    out['rope_scaling'] = None
  elif kind == 'llama3':
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
      raise fail(f'rope_scaling: missing key {missing[0]!r} for rope_type llama3')
    out['rope_scaling'] = {'rope_type': 'llama3', **{k: rope[k] for k in _LLAMA3_KEYS}}
  else:
    raise fail(f'rope_scaling: rope_type {kind!r} is not supported (only llama3 or none)')
  return out


def to_json(cfg, *, dtype: str, max_position_embeddings: int) -> dict[str, Any]:
  """The config.json of `cfg` (a `ModelConfig`) as transformers' LlamaForCausalLM reads it.

  Args:
    cfg: the model's config.
    dtype: the weights' dtype name in the safetensors files ('float32' or 'bfloat16').
    max_position_embeddings: the context length to record.
  """
  shape = cfg.shape()
  scaling = cfg.rope_scaling
  return {
      'architectures': [ARCHITECTURE],
      'model_type': 'llama',
      'hidden_size': shape.dim,
      'intermediate_size': shape.ffn_dim,
      'num_hidden_layers': shape.n_layers,
      'num_attention_heads': shape.n_heads,
      'num_key_value_heads': shape.kv_heads,
      'head_dim': shape.head_dim,
      'vocab_size': shape.vocab_size,
      'tie_word_embeddings': shape.tie_embeddings,
      'rms_norm_eps': float(cfg.norm_eps),
      'rope_theta': float(cfg.rope_theta),
      'rope_scaling': None if scaling is None else {
          'rope_type': scaling.rope_type, **{k: getattr(scaling, k) for k in _LLAMA3_KEYS}},
      'max_position_embeddings': max_position_embeddings,
      'hidden_act': 'silu',
      'attention_bias': False,
      'mlp_bias': False,
      'attention_dropout': 0.0,
      'initializer_range': 0.02,
      'torch_dtype': dtype,
      'use_cache': True,
  }
