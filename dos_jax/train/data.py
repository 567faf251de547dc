"""Reading token datasets: `load_meta` checks one, `BatchSampler` reads random windows;
and the runner's `DataConfig`, which names the dataset (or prepares the default one).

The format on disk, and `prepare`, which writes a dataset, are
`dos_jax.train.prepare`'s; their public names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

import dos_jax
from dos_jax.train.prepare import DEFAULT_CORPUS_BYTES as DEFAULT_CORPUS_BYTES
from dos_jax.train.prepare import DatasetMeta as DatasetMeta
from dos_jax.train.prepare import dtype_for
from dos_jax.train.prepare import META as META
from dos_jax.train.prepare import MIN_VAL_TOKENS as MIN_VAL_TOKENS
from dos_jax.train.prepare import prepare as prepare
from dos_jax.train.prepare import SPLITS as SPLITS
from dos_jax.train.prepare import stdlib_dir as stdlib_dir


def load_meta(dataset_dir: str | Path) -> DatasetMeta:
  """Reads and checks meta.json and the .bin sizes; ValueError naming the file if not."""
  root = Path(dataset_dir)
  if not root.is_dir():
    raise ValueError(f'dataset directory {root} does not exist; make one with `dos-jax prepare`')
  meta_path = root / META
  if not meta_path.is_file():
    raise ValueError(f'{meta_path} not found: {root} is not a prepared dataset (`dos-jax prepare`)')
  try:
    raw = json.loads(meta_path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{meta_path} is not valid JSON: {e}') from None
  if not isinstance(raw, dict):
    raise ValueError(f'{meta_path} must hold a JSON object')
  fields = {f.name for f in dataclasses.fields(DatasetMeta)}
  missing = sorted(fields - raw.keys())
  if missing:
    raise ValueError(f'{meta_path} lacks {", ".join(missing)}')
  try:
    meta = DatasetMeta(**{k: raw[k] for k in fields})
    meta = dataclasses.replace(meta, sources=tuple(meta.sources))
  except TypeError as e:
    raise ValueError(f'{meta_path}: {e}') from None
  for name in ('vocab_size', 'train_tokens', 'val_tokens'):
    value = getattr(meta, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ValueError(f'{meta_path}: {name} must be a non-negative integer, got {value!r}')
  if meta.dtype not in ('uint16', 'uint32') or np.dtype(meta.dtype) != dtype_for(meta.vocab_size):
    raise ValueError(f'{meta_path}: dtype {meta.dtype!r} does not fit vocab_size {meta.vocab_size}')
  itemsize = np.dtype(meta.dtype).itemsize
  for split in SPLITS:
    path = root / f'{split}.bin'
    if not path.is_file():
      raise ValueError(f'{path} not found (listed in {meta_path})')
    expected = meta.num_tokens(split) * itemsize
    if path.stat().st_size != expected:
      raise ValueError(
          f'{path} has {path.stat().st_size} bytes; {META} says {meta.num_tokens(split)} '
          f'{meta.dtype} tokens ({expected} bytes): the dataset is corrupt, prepare it again'
      )
  return meta


def max_token(dataset_dir: str | Path, split: str, meta: DatasetMeta) -> int:
  """The largest token id in a split (-1 if empty), read in pieces of 64 Mi tokens:
  one pass over the file, about a second per GB."""
  tokens = np.memmap(Path(dataset_dir) / f'{split}.bin', dtype=meta.dtype, mode='r')
  top = -1
  for start in range(0, len(tokens), 64 * 2**20):
    top = max(top, int(tokens[start:start + 64 * 2**20].max()))
  return top


# ----- the runner's data config and sampler -----


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where training tokens come from and how they are cut into batches."""

  # Prepared dataset directory (train.bin, val.bin, meta.json); None prepares the default
  # corpus once into default_cache_dir() and reuses it.
  path: str | None = None
  # Tokens per training sequence; each sampled window holds seq_len + 1 for the shift.
  seq_len: int = 128
  # Sequences per global batch (split over the mesh's `data` axis).
  batch_size: int = 32
  # Share of the default corpus held out for validation (ignored when `path` is given).
  val_fraction: float = 0.01
  # Seed of the window positions; with the step number it fixes every batch.
  seed: int = 0

  def __post_init__(self):
    if self.path is not None and not isinstance(self.path, str):
      raise ValueError(f'DataConfig.path must be a string or null, got {self.path!r}')
    for name in ('seq_len', 'batch_size'):
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise ValueError(f'DataConfig.{name} must be a positive integer, got {value!r}')
    if (isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float))
        or not 0 <= self.val_fraction < 1):
      raise ValueError(f'DataConfig.val_fraction must be in [0, 1), got {self.val_fraction!r}')
    if not _is_int(self.seed) or self.seed < 0:
      raise ValueError(f'DataConfig.seed must be a non-negative integer, got {self.seed!r}')


def default_cache_dir() -> Path:
  """<dos_jax cache>/data/stdlib-bytes (see `dos_jax.cache_dir`: $DOS_JAX_CACHE_DIR, else
  $XDG_CACHE_HOME/dos_jax, else ~/.cache/dos_jax)."""
  return dos_jax.cache_dir('data', 'stdlib-bytes')


def resolve_dataset(cfg: DataConfig, *, progress: bool = True) -> Path:
  """The dataset directory for `cfg`, preparing the default corpus on first use."""
  if cfg.path is not None:
    load_meta(cfg.path)
    return Path(cfg.path)
  root = default_cache_dir()
  try:
    meta = load_meta(root)
    if meta.val_fraction == cfg.val_fraction and meta.max_bytes == DEFAULT_CORPUS_BYTES:
      return root
  except ValueError:
    pass  # Absent or incomplete: prepare it below.
  prepare(None, root, val_fraction=cfg.val_fraction, progress=progress)
  return root


class BatchSampler:
  """Random (batch_size, seq_len + 1) windows of one split, as int32.

  Batch n depends only on (seed, split, n), so the sampler's whole position is the step
  count: `state()` saves it, `restore()` resumes exactly where it left off.
  """

  def __init__(self, dataset_dir: str | Path, split: str, batch_size: int, seq_len: int,
               seed: int):
    if split not in SPLITS:
      raise ValueError(f'split must be one of {", ".join(SPLITS)}, got {split!r}')
    for name, value in (('batch_size', batch_size), ('seq_len', seq_len)):
      if not _is_int(value) or value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')
    if not _is_int(seed) or seed < 0:
      raise ValueError(f'seed must be a non-negative integer, got {seed!r}')
    self.meta = load_meta(dataset_dir)
    path = Path(dataset_dir) / f'{split}.bin'
    self.num_tokens = self.meta.num_tokens(split)
    if self.num_tokens < seq_len + 1:
      raise ValueError(
          f'{path} holds {self.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}'
      )
    self._tokens = np.memmap(path, dtype=self.meta.dtype, mode='r')
    self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
    self.seed, self.step = seed, 0
    self._offsets = np.arange(seq_len + 1)

  @property
  def vocab_size(self) -> int:
    return self.meta.vocab_size

  def batch_at(self, step: int) -> np.ndarray:
    """Batch number `step`, without moving the sampler."""
    entropy = [self.seed, SPLITS.index(self.split), step]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    starts = rng.integers(0, self.num_tokens - self.seq_len, size=self.batch_size)
    return self._tokens[starts[:, None] + self._offsets].astype(np.int32)

  def __iter__(self) -> BatchSampler:
    return self

  def __next__(self) -> np.ndarray:
    batch = self.batch_at(self.step)
    self.step += 1
    return batch

  def state(self) -> dict[str, int]:
    """JSON-serializable position: {'step', 'seed'}."""
    return {'step': self.step, 'seed': self.seed}

  def restore(self, state: dict[str, int]) -> None:
    """Resumes at a position from `state()`."""
    if not isinstance(state, dict) or set(state) != {'step', 'seed'}:
      raise ValueError(f'sampler state must be {{"step": int, "seed": int}}, got {state!r}')
    for key in ('step', 'seed'):
      if not _is_int(state[key]) or state[key] < 0:
        raise ValueError(f'sampler state {key} must be a non-negative integer, got {state[key]!r}')
    self.step, self.seed = state['step'], state['seed']


def sampler_for(cfg: DataConfig, dataset_dir: str, split: str) -> BatchSampler:
  """The run's sampler of `split` ('train' or 'val') of the prepared data in `dataset_dir`."""
  return BatchSampler(dataset_dir, split, cfg.batch_size, cfg.seq_len, cfg.seed)
