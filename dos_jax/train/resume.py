"""Resuming a run: what it must share with the run that wrote its checkpoint, which
checkpoint it resumes (`resume_point`), and restoring it (`restore`).

A checkpoint holds params of one shape trained on one data stream. Resuming it with
other model sizes fails deep inside orbax; resuming it with another batch size, window
length, data seed or dataset silently continues a different run. So each checkpoint's
manifest records the run's `identity`, and the loop compares it with the new config
before it writes anything, refusing with one line that names the first key that
differs. Everything else (steps, learning rate, placement policy, mesh) may change, and
the subgroup size too, except for a checkpoint of a disk tier (kept by subgroup).
"""

from __future__ import annotations

import os
from typing import Any, TextIO

import dos_jax
from dos_jax.train import checkpoint as ckpt_lib
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
      # A disk tier's checkpoints keep the state by subgroup (`dos_jax.state_to_files`):
      # resuming one needs the same subgroups (checked only for such a checkpoint).
      'offload.subgroup_size': cfg.offload.subgroup_size,
  }


def check(saved: dict[str, Any] | None, now: dict[str, Any], where: str,
          by_subgroup: bool = False) -> None:
  """Raises ConfigError for the first key whose value differs from the checkpoint's;
  the subgroup size only for a checkpoint that keeps its state `by_subgroup`.

  A manifest without a record (written outside the runner) is not checked.
  """
  if not saved:
    return
  for key, value in now.items():
    if key not in saved or saved[key] == value:
      continue
    if key == 'offload.subgroup_size':
      if by_subgroup:
        raise ConfigError(
            f'{key}: {value!r} differs from {saved[key]!r} in the checkpoint being resumed'
            f' ({where}), which keeps its disk tier\'s optimizer state by subgroup: restore'
            ' the value or set a new train.out_dir')
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


def resume_point(cfg: Any, run_id: dict[str, Any]):
  """The checkpoint to resume (after the identity check) and the damaged newer ones.

  Reads only. Raises ConfigError if resuming would change the model or data stream.
  """
  restorable, manifest, skipped = ckpt_lib.find_restorable(cfg.checkpoint_dir)
  if manifest is not None:
    where = os.path.join(cfg.checkpoint_dir, str(restorable))
    check(manifest.get('run'), run_id, where,
          by_subgroup=os.path.isdir(os.path.join(where, ckpt_lib.SUBGROUPS)))
  return restorable, manifest is not None, skipped


def check_packing(cfg: Any, latest: int | None, opt_state: Any) -> None:
  """Raises ConfigError, naming `mesh`, where checkpoint `latest` keeps a disk tier's
  files that cannot fill `opt_state` (the run's fresh state) as it is packed (another
  mesh: `dos_jax.files_packing_mismatch`). Reads only."""
  if latest is None:
    return
  where = os.path.join(cfg.checkpoint_dir, str(latest))
  files = os.path.join(where, ckpt_lib.SUBGROUPS)
  mismatch = os.path.isdir(files) and dos_jax.files_packing_mismatch(files, opt_state)
  if mismatch:
    raise ConfigError(f'mesh: {mismatch} ({where}), or set a new train.out_dir')


def restore(cfg: Any, checkpointer: ckpt_lib.Checkpointer, trainer, sampler, *,
            latest: int | None, verified: bool, skipped, stream: TextIO) -> int:
  """Sets the damaged checkpoints aside (`skipped`, from `resume_point`), restores
  `latest` (if any) into `trainer` and `sampler`, and says so on `stream`; returns the
  step the run continues from."""
  for name in checkpointer.discarded:
    print(f'checkpoint {name.split(".")[0]} was cut short ({name} in'
          f' {checkpointer.directory}); discarded', file=stream)
  for item, moved in zip(skipped, checkpointer.quarantine(skipped)):
    fallback = f'step {latest}' if latest is not None else 'the start (no complete checkpoint)'
    print(f'checkpoint {item.step} is {item.reason}; moved to {moved}, resuming from'
          f' {fallback}', file=stream)
  if latest is not None and not verified:
    print(f'checkpoint {latest} has no checksum manifest (written before checksums, or'
          ' its save was cut short): resuming from it unverified', file=stream)
  if latest is None:
    return 0
  release = getattr(trainer, 'release_params', None)  # a pipelined run's keeps them
  params = release() if release is not None else trainer.params
  restored = checkpointer.restore(
      latest, params=params, opt_state=trainer.opt_state, tx=trainer.tx
  )
  trainer.set_state(restored.params, restored.opt_state)
  sampler.restore(restored.meta['sampler'])
  print(f'resumed from {cfg.checkpoint_dir} at step {restored.step}', file=stream)
  return restored.step
