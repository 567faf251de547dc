"""What a resumed run must share with the run that wrote its checkpoint.

A checkpoint holds params of one shape trained on one data stream. Resuming it with
other model sizes fails deep inside orbax; resuming it with another batch size, window
length, data seed or dataset silently continues a different run. So each checkpoint's
manifest records the run's `identity`, and the loop compares it with the new config
before it writes anything, refusing with one line that names the first key that
differs. Everything else (steps, learning rate, placement policy, mesh) may change.
"""

from __future__ import annotations

import os
from typing import Any

from dos_jax.train.configlib import ConfigError


def identity(cfg: Any, dataset_dir: str, dataset_meta: Any) -> dict[str, Any]:
  """The keys that fix the model's shape and the data stream, as JSON values."""
  shape = cfg.model.shape()
  return {
      'model.dim': shape.dim,
      'model.ffn_dim': shape.ffn_dim,
      'model.n_layers': shape.n_layers,
      'model.n_heads': shape.n_heads,
      'model.vocab_size': shape.vocab_size,
      'model.n_kv_heads': shape.kv_heads,
      'model.tie_embeddings': shape.tie_embeddings,
      'model.param_dtype': cfg.model.param_dtype,
      'data.batch_size': cfg.data.batch_size,
      'data.seq_len': cfg.data.seq_len,
      'data.seed': cfg.data.seed,
      'data.path': os.path.realpath(dataset_dir),
      'data.train_tokens': dataset_meta.train_tokens,
      'data.val_tokens': dataset_meta.val_tokens,
  }


def check(saved: dict[str, Any] | None, now: dict[str, Any], where: str) -> None:
  """Raises ConfigError for the first key whose value differs from the checkpoint's.

  A manifest without a record (written outside the runner) is not checked.
  """
  if not saved:
    return
  for key, value in now.items():
    if key not in saved or saved[key] == value:
      continue
    if key in ('data.train_tokens', 'data.val_tokens'):
      split = key.split('.')[1].split('_')[0]
      raise ConfigError(
          f'data.path: the dataset {now["data.path"]} has {value} {split} tokens, but'
          f' {saved[key]} when the checkpoint being resumed ({where}) was written;'
          ' resuming would change the data stream: use the same dataset or set a new'
          ' train.out_dir'
      )
    raise ConfigError(
        f'{key}: {value!r} differs from {saved[key]!r} in the checkpoint being resumed'
        f' ({where}); resuming would change the model or the data stream: restore the'
        ' value or set a new train.out_dir'
    )
