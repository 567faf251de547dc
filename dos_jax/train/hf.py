"""Hugging Face Llama checkpoints in and out: `config.json` plus safetensors files.

`load(folder)` returns the `ModelConfig` and parameters of a `LlamaForCausalLM` folder
(one `model.safetensors`, or shards listed in `model.safetensors.index.json`);
`save(cfg, params, folder)` writes one that `transformers` loads. With
`dos_jax.train.model.make_apply` that is three lines from a checkpoint to logits:

  >>> import jax, numpy as np
  >>> from dos_jax.train import hf, model
  >>> cfg, params = hf.load('Llama-3.2-1B', compute_dtype='float32')
  >>> logits_BxLxV = jax.jit(model.make_apply(cfg))(params, np.array([[128000, 9906]]))

Files are read one tensor at a time with the `safetensors` package's `pread` backend (no
memory map whose pages would stay resident), each cast to `param_dtype` and handed to
`place` before the next is read, so the host holds the converted parameters and one
tensor at most; the runner's `place` puts each on its devices at once, each device
getting its own shards. All names and shapes are checked against `config.json` from the
files' headers before any tensor is read.

Layouts (HF (out, in) linear weights -> this model's kernels, H heads of width K, G
key/value heads): q_proj (H*K, D) -> wq (D, H, K); k_proj, v_proj (G*K, D) -> (D, G, K);
o_proj (D, H*K) -> wo (H, K, D); gate/up_proj (F, D) -> (D, F); down_proj (D, F) -> (F, D);
lm_head (V, D) -> head (D, V); the embedding and norm scales as they are. Both use the
half-split rotary layout, so no permutation is needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

from dos_jax.train import hf_config
from dos_jax.train import model as model_lib

INDEX_JSON = 'model.safetensors.index.json'
SINGLE_FILE = 'model.safetensors'
# transformers' default `max_shard_size` (5 GB, decimal).
MAX_SHARD_BYTES = 5 * 10**9
_FILE_DTYPES = {'F32': np.float32, 'BF16': ml_dtypes.bfloat16, 'F16': np.float16}
# Buffers some older checkpoints carry that the model recomputes; skipped on read.
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)

Place = Callable[[tuple[str, ...], np.ndarray], Any]


class CheckpointError(ValueError):
  """A Hugging Face checkpoint that does not match its config.json or this model; the
  message is one line naming the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One HF tensor: its name, the param it becomes, and the two layouts."""

  name: str
  path: tuple[str, ...]  # Keys into the params dict.
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def tensors(cfg: model_lib.ModelConfig) -> list[_Tensor]:
  """Every tensor of `cfg`'s Llama checkpoint, in transformers' order."""
  s = cfg.shape()
  d, f, v, k = s.dim, s.ffn_dim, s.vocab_size, s.head_dim
  same = lambda x: x
  out = [_Tensor('model.embed_tokens.weight', ('embedding',), (v, d), same, same)]
  for i in range(s.n_layers):
    b, pre = model_lib.block_name(i, s.n_layers), f'model.layers.{i}.'
    for proj, ours, heads in (('q', 'wq', s.n_heads), ('k', 'wk', s.kv_heads),
                              ('v', 'wv', s.kv_heads)):
      out.append(_Tensor(
          f'{pre}self_attn.{proj}_proj.weight', ('blocks', b, 'attn', ours), (heads * k, d),
          lambda x, n=heads: x.T.reshape(d, n, k), lambda x: x.reshape(d, -1).T))
    out.append(_Tensor(
        f'{pre}self_attn.o_proj.weight', ('blocks', b, 'attn', 'wo'), (d, s.n_heads * k),
        lambda x: x.T.reshape(s.n_heads, k, d), lambda x: x.reshape(-1, d).T))
    for proj, ours, hf_shape in (('gate', 'w_gate', (f, d)), ('up', 'w_up', (f, d)),
                                 ('down', 'w_down', (d, f))):
      out.append(_Tensor(f'{pre}mlp.{proj}_proj.weight', ('blocks', b, 'mlp', ours), hf_shape,
                         np.transpose, np.transpose))
    out.append(_Tensor(f'{pre}input_layernorm.weight', ('blocks', b, 'attn_norm', 'scale'),
                       (d,), same, same))
    out.append(_Tensor(f'{pre}post_attention_layernorm.weight',
                       ('blocks', b, 'mlp_norm', 'scale'), (d,), same, same))
  out.append(_Tensor('model.norm.weight', ('final_norm', 'scale'), (d,), same, same))
  if not s.tie_embeddings:
    out.append(_Tensor('lm_head.weight', ('head',), (v, d), np.transpose, np.transpose))
  return out


def load(folder: str, **overrides) -> tuple[model_lib.ModelConfig, dict]:
  """The model config and parameters of a Hugging Face Llama checkpoint folder.

  Args:
    folder: a local folder with config.json and model.safetensors (or shards and
      model.safetensors.index.json).
    **overrides: other `ModelConfig` fields. Defaults here: `param_dtype` the files'
      `torch_dtype` when float32 or bfloat16 (else float32), `max_seq_len` the config's
      `max_position_embeddings`.

  Returns:
    (cfg, params): params a nested dict of numpy arrays in `cfg.param_dtype`, shaped as
    `model.init_params(cfg, seed)`'s.

  Raises:
    ValueError: config.json is missing, not a Llama or not one this model holds.
    CheckpointError: a tensor is missing, unknown or of another shape than config.json
      gives (nothing is read past the headers then).
  """
  raw = _read_json(hf_config.config_path(folder))
  dtype = raw.get('torch_dtype', raw.get('dtype'))
  defaults = {'param_dtype': dtype if dtype in ('float32', 'bfloat16') else 'float32'}
  if isinstance(raw.get('max_position_embeddings'), int):
    defaults['max_seq_len'] = raw['max_position_embeddings']
  cfg = model_lib.ModelConfig(from_hf=folder, **{**defaults, **overrides})
  return cfg, read_params(folder, cfg)


def read_params(folder: str, cfg: model_lib.ModelConfig, place: Place | None = None) -> dict:
  """The parameters of `cfg` (resolved from `folder`) read from `folder`'s safetensors.

  Args:
    folder: the checkpoint folder.
    cfg: its model config (sizes from its config.json).
    place: called with (path, host array in param_dtype) per tensor, as it is read;
      returns the leaf to keep (e.g. a sharded jax.Array). Default: keep the array.

  Raises:
    CheckpointError: see `load`.
  """
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  wanted = {t.name: t for t in tensors(cfg)}
  headers = _headers(folder)
  for name, (path, _, _) in headers.items():
    if name not in wanted and not name.endswith(_IGNORED_SUFFIXES) and not (
        name == 'lm_head.weight' and cfg.shape().tie_embeddings):
      raise CheckpointError(f'{path}: unknown tensor {name!r} (not part of a'
                            f' LlamaForCausalLM with this config.json)')
  for name, t in wanted.items():  # In the model's order: the first layer's first.
    if name not in headers:
      raise CheckpointError(f'{folder}: tensor {name!r} is missing from the safetensors files')
    path, _, shape = headers[name]
    if shape != t.hf_shape:
      raise CheckpointError(f'{path}: tensor {name!r} has shape {shape}, but config.json'
                            f' gives {t.hf_shape}')
  dtype = cfg.param_jnp_dtype
  place = place or (lambda _, array: array)
  params: dict = {}
  for file in sorted({path for path, _, _ in headers.values()}):
    with safe_open(file, framework='numpy', backend='pread') as f:
      for name in f.keys():
        if name not in wanted:
          continue
        t = wanted[name]
        array = np.asarray(t.to_ours(f.get_tensor(name)), dtype=dtype, order='C')
        node = params
        for key in t.path[:-1]:
          node = node.setdefault(key, {})
        node[t.path[-1]] = place(t.path, array)
        del array
  return params


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f'{path}: no such file') from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise CheckpointError(f'{path}: cannot read it as JSON ({type(err).__name__})') from None
  if not isinstance(data, dict):
    raise CheckpointError(f'{path}: expected a JSON object')
  return data


def _headers(folder: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
  """{tensor name: (file, file dtype, shape)} from the safetensors headers alone."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  index = os.path.join(folder, INDEX_JSON)
  if os.path.exists(index):
    weight_map = _read_json(index).get('weight_map')
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f'{index}: no weight_map')
    files = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
    weight_map, files = None, [SINGLE_FILE]
  else:
    raise CheckpointError(f'{folder}: neither {SINGLE_FILE} nor {INDEX_JSON} is there')
  out = {}
  for name in files:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise CheckpointError(f'{index}: lists {name}, which is not in {folder}')
    try:
      with safe_open(path, framework='numpy', backend='pread') as f:
        for key in f.keys():
          view = f.get_slice(key)
          if view.get_dtype() not in _FILE_DTYPES:
            raise CheckpointError(f'{path}: tensor {key!r} has dtype {view.get_dtype()}'
                                  f' (only {", ".join(_FILE_DTYPES)} are read)')
          if weight_map is not None and weight_map.get(key) != name:
            raise CheckpointError(f'{path}: holds {key!r}, which {index} does not list'
                                  ' for this file')
          out[key] = (path, view.get_dtype(), tuple(view.get_shape()))
    except CheckpointError:
      raise
    except Exception as err:  # pylint: disable=broad-exception-caught
      # safetensors raises its own SafetensorError (and OSError) for a damaged file.
      first = (str(err).splitlines() or [type(err).__name__])[0]
      raise CheckpointError(f'{path}: not a readable safetensors file ({first})') from None
  return out


def save(cfg: model_lib.ModelConfig, params: Any, folder: str, *,
         max_shard_bytes: int = MAX_SHARD_BYTES, extra_files: tuple[str, ...] = (),
         max_position_embeddings: int | None = None, consume: bool = False) -> None:
  """Writes `params` of model `cfg` as a Hugging Face LlamaForCausalLM folder.

  Atomic: everything goes into a temporary folder beside `folder`, renamed to it once
  complete, so a killed save leaves no half folder under its name.

  Args:
    cfg: the model config.
    params: its parameters (jax or numpy arrays), in `cfg.param_dtype`, which the files
      keep.
    folder: must not exist, or be an empty folder.
    max_shard_bytes: files above this size are split into shards with an index.
    extra_files: files copied in beside the weights (tokenizer files).
    max_position_embeddings: recorded in config.json (default `cfg.max_seq_len`).
    consume: delete each leaf from `params` (a nested dict, emptied) once converted, so
      the host holds each tensor once, not the params beside the file being written.

  Example:
    >>> cfg = model.ModelConfig(preset='tiny', compute_dtype='float32')
    >>> hf.save(cfg, model.init_params(cfg, 0), '/tmp/tiny-llama')
  """
  folder = os.path.abspath(folder)
  if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
    raise FileExistsError(f'{folder}: exists and is not an empty folder')
  parent = os.path.dirname(folder)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(folder)}.tmp-', dir=parent)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stay on the renamed folder.
  try:
    _write(cfg, params, tmp, max_shard_bytes, max_position_embeddings or cfg.max_seq_len,
           consume)
    for path in extra_files:
      shutil.copy2(path, os.path.join(tmp, os.path.basename(path)))
    for name in os.listdir(tmp):
      # Readable like files `open` makes (safetensors writes its files 0600; copies keep
      # their source's mode): 0666 less the umask.
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.replace(tmp, folder)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _write(cfg, params, folder: str, max_shard_bytes: int, max_positions: int,
           consume: bool) -> None:
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  dtype = np.dtype(cfg.param_jnp_dtype)
  shards = list(_shards(tensors(cfg), dtype.itemsize, max_shard_bytes))
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))])
  weight_map, total = {}, 0
  for name, shard in zip(names, shards):
    arrays = {}
    for t in shard:
      node = params
      for key in t.path[:-1]:
        node = node[key]
      leaf = node.pop(t.path[-1]) if consume else node[t.path[-1]]
      array = np.ascontiguousarray(t.to_hf(np.asarray(leaf)), dtype=dtype)
      leaf_shape = np.shape(leaf)
      del leaf
      if array.shape != t.hf_shape:
        raise ValueError(f'params{list(t.path)}: shape {leaf_shape} does not fit the'
                         f' config (as {t.name!r}: {array.shape}, expected {t.hf_shape})')
      arrays[t.name] = array
      weight_map[t.name] = name
      total += array.nbytes
    save_file(arrays, os.path.join(folder, name), metadata={'format': 'pt'})
    del arrays
  if len(shards) > 1:
    with open(os.path.join(folder, INDEX_JSON), 'w', encoding='utf-8') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  config = hf_config.to_json(cfg, dtype=dtype.name, max_position_embeddings=max_positions)
  with open(hf_config.config_path(folder), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)


def _shards(items: list[_Tensor], itemsize: int, limit: int) -> Iterator[list[_Tensor]]:
  """`items` in order, cut where a shard would pass `limit` bytes."""
  shard, size = [], 0
  for t in items:
    nbytes = int(np.prod(t.hf_shape)) * itemsize
    if shard and size + nbytes > limit:
      yield shard
      shard, size = [], 0
    shard.append(t)
    size += nbytes
  if shard:
    yield shard
