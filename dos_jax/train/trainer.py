"""A `Trainer`: the model, mesh, optimizer and jitted step functions of one run.

`build` does everything that can fail on the user's input (mesh sizes, dataset path,
tensor splits) and writes nothing, so the loop can check a run before creating its
directory. The loop, the tests and the benchmark all drive training through
`Trainer.step` (one fused program, or the split pair when the update phase is to be
timed), so they measure and compare the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import numpy as np
import optax

import dos_jax
from dos_jax.train import agree
from dos_jax.train import checkpoint as ckpt_lib
from dos_jax.train import data as data_lib
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import optimizer as optimizer_lib
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError
from dos_jax.train.results import StepResult
from dos_jax.train.sharding import TENSOR


@dataclasses.dataclass
class Trainer:
  """The live state of a run; `params` and `opt_state` are replaced every step."""

  cfg: RunConfig
  mesh: jax.sharding.Mesh
  dataset_dir: str
  apply: Any
  tx: optax.GradientTransformation
  params: Any
  opt_state: Any
  param_shardings: Any
  state_shardings: Any
  batch_sharding: jax.sharding.NamedSharding
  train_step: Any
  grad_step: Any
  update_step: Any
  eval_step: Any
  # The params came from `model.from_hf` (False: initialized, to be replaced by a
  # checkpoint being resumed, or a run with no from_hf).
  started_from_hf: bool = False

  def place_batch(self, tokens_BxLp1: np.ndarray) -> jax.Array:
    return jax.device_put(tokens_BxLp1, self.batch_sharding)

  def step(self, tokens_BxLp1: np.ndarray, plan: Any = None, *, split: bool = False) -> StepResult:
    """One optimizer step on a host batch, blocking until it is done.

    Fused (default): one program, forward to applied update. `split`: the same math as
    two programs, gradients then update, each timed on its own (see `step_lib`). A
    `plan` that needs other tiers than the state has first moves its rows
    (`dos_jax.migrate`, timed apart as `migrate_s`).
    """
    migrate_s = 0.0
    if plan is not None:
      t0 = time.perf_counter()
      moved = dos_jax.migrate(self.opt_state, plan,
                              early=optimizer_lib.early_for(self.cfg, self.opt_state, plan))
      if moved is not self.opt_state:
        self.opt_state = jax.block_until_ready(moved)
        migrate_s = time.perf_counter() - t0
    tokens = self.place_batch(tokens_BxLp1)
    programs = self._programs()
    t0 = time.perf_counter()
    grad_s = update_s = None
    if split:
      grads, grad_scale, stats = self.grad_step(self.params, tokens)
      jax.block_until_ready((grads, grad_scale, stats))
      t1 = time.perf_counter()
      self.params, self.opt_state = self.update_step(
          self.params, self.opt_state, grads, grad_scale, plan=plan
      )
      jax.block_until_ready((self.params, self.opt_state))
      grad_s, update_s = t1 - t0, time.perf_counter() - t1
    else:
      self.params, self.opt_state, stats = self.train_step(
          self.params, self.opt_state, tokens, plan=plan
      )
      jax.block_until_ready((self.params, self.opt_state, stats))
    step_s = time.perf_counter() - t0
    return StepResult(
        loss=float(stats['loss']), grad_norm=float(stats['grad_norm']), step_s=step_s,
        grad_s=grad_s, update_s=update_s, compiled=self._programs() != programs,
        migrate_s=migrate_s,
    )

  def set_state(self, params: Any, opt_state: Any) -> None:
    """Adopts restored state, committed to this run's shardings (no recompile)."""
    self.params = jax.device_put(params, self.param_shardings)
    self.opt_state = jax.device_put(opt_state, self.state_shardings)

  def release_params(self) -> Any:
    """Frees the params' buffers and returns their shapes, dtypes and shardings: a
    resume replaces them, and a model of half the machine's memory should not be held
    twice while its checkpoint is read. `set_state` gives the trainer params again."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params)
    for x in jax.tree.leaves(self.params):
      x.delete()
    self.params = None
    return abstract

  def evaluate(self, num_batches: int) -> float:
    """Mean loss over the first `num_batches` validation batches (the same every time)."""
    sampler = data_lib.sampler_for(self.cfg.data, self.dataset_dir, 'val')
    total = 0.0
    for _ in range(num_batches):
      total += float(self.eval_step(self.params, self.place_batch(next(sampler))))
    return total / num_batches

  def train_sampler(self) -> Any:
    return data_lib.sampler_for(self.cfg.data, self.dataset_dir, 'train')

  def compile_counts(self) -> dict[str, int]:
    """Compiled variants of each jitted program: the fused step and the split pair
    (stays at most 1 per plan each across steps; 0 for a form never run)."""
    # pylint: disable=protected-access
    return {
        'fused': self.train_step.compiles(),
        'grad': self.grad_step._cache_size(),
        'update': self.update_step.jitted._cache_size(),
    }

  def _programs(self) -> int:
    return sum(self.compile_counts().values())


def dataset_dir_for(cfg: data_lib.DataConfig) -> str:
  """The prepared dataset to train on: `data.path`, or the default corpus (prepared
  once into a cache directory on first use, never into the run directory)."""
  try:
    return str(data_lib.resolve_dataset(cfg))
  except ValueError as err:
    raise ConfigError(f'data.path: {err}') from None


def check_dataset(cfg: RunConfig, dataset_dir: str) -> None:
  """Checks the dataset against the run before anything trains on it: each split holds
  a window of seq_len + 1 tokens, and every token id is an embedding row of the model
  (an out-of-range id reads garbage and trains to NaN). One line naming the file."""
  meta = data_lib.load_meta(dataset_dir)
  vocab = cfg.model.shape().vocab_size
  meta_path = os.path.join(dataset_dir, data_lib.META)
  if meta.vocab_size > vocab:
    key = 'model.vocab_size' if cfg.model.from_hf is None else (
        f'model.from_hf: vocab_size in {os.path.join(cfg.model.from_hf, "config.json")}')
    raise ConfigError(
        f'{key}: {vocab} is smaller than the vocabulary of the dataset'
        f' ({meta.vocab_size}, {meta_path})'
    )
  for split in data_lib.SPLITS:
    path = os.path.join(dataset_dir, f'{split}.bin')
    num = meta.num_tokens(split)
    if num < cfg.data.seq_len + 1:
      raise ConfigError(
          f'data.path: {path} holds {num} tokens, fewer than data.seq_len + 1 ='
          f' {cfg.data.seq_len + 1}; use a smaller data.seq_len or run `dos-jax prepare`'
          f' again with more text or a larger --min-val-tokens'
      )
    top = data_lib.max_token(dataset_dir, split, meta)
    if top >= meta.vocab_size:
      raise ConfigError(
          f'data.path: {path} holds token id {top}, out of range for the vocabulary of'
          f' {meta.vocab_size} in {meta_path}'
      )


def hf_params(cfg: RunConfig, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
  """The params of `model.from_hf`, each tensor placed on its devices as it is read
  (each device gets only its own shards), and their shardings.

  Raises:
    ConfigError: the checkpoint's tensors do not match its config.json (names the file).
  """
  from dos_jax.train import hf  # pylint: disable=import-outside-toplevel

  abstract = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  param_shardings = mesh_lib.param_shardings(mesh, abstract)

  def place(path, host):
    sharding = param_shardings
    for key in path:
      sharding = sharding[key]
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  try:
    return hf.read_params(cfg.model.from_hf, cfg.model, place), param_shardings
  except hf.CheckpointError as err:
    raise ConfigError(f'model.from_hf: {err}') from None


def _check_disk_processes(cfg: RunConfig, mesh: jax.sharding.Mesh) -> None:
  """A disk tier's first generation is written by each process from its own shards of
  the params (`dos_jax.Disk`): in a run of several processes, the `tensor` shards of
  each device's params must be on devices of its own process, and a ZeRO-3 state
  packed by the params' shards (the two-memory program's). One line naming the key."""
  processes = agree.processes()
  if cfg.offload.disk_dir is None or processes == 1:
    return
  if mesh_lib.has_fsdp(mesh) and step_lib.make_implementation(
      cfg.offload).target() is not dos_jax.Program.TWO_MEMORIES:
    raise ConfigError(f'offload.disk_dir: a ZeRO-3 run (mesh.fsdp={cfg.mesh.fsdp}) of '
                      f'{processes} processes keeps its optimizer state on disk only in the '
                      'two-memory program, which packs each device\'s state from its own '
                      'shards of the params; set offload.platform=gpu or unset '
                      'offload.disk_dir')
  if TENSOR not in mesh.shape:
    return
  owners = np.vectorize(lambda device: device.process_index)(mesh.devices)
  if (owners != owners.take([0], axis=list(mesh.axis_names).index(TENSOR))).any():
    raise ConfigError(f'offload.disk_dir: a run of {processes} processes keeps its '
                      'optimizer state on disk only where each process holds every '
                      'mesh.tensor shard of its devices\' params; keep mesh.tensor within '
                      'a process or unset offload.disk_dir')


def check_mesh(cfg: RunConfig,
               devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The run's mesh over `devices` (default: all), checked against the batch and the disk
  tier's processes before anything is prepared or built.

  Raises:
    ConfigError: the mesh does not fit the devices or the batch (names the key).
  """
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  mesh_lib.check_divisible(mesh, cfg.data.batch_size)
  _check_disk_processes(cfg, mesh)
  return mesh


def build(
    cfg: RunConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    tx: optax.GradientTransformation | None = None,
    from_hf: bool | None = None,
    restoring: bool = False,
) -> Trainer:
  """Assembles a run from its config, writing nothing.

  Args:
    cfg: the run config.
    devices: devices of the mesh (default: all).
    tx: an optimizer to use instead of the configured dos_jax AdamW (the tests and the
      benchmark pass `optax.adamw` here as the reference).
    from_hf: start from `model.from_hf`'s weights; None: when it is set and the run
      has no checkpoint to resume (whose params would replace them).
    restoring: a checkpoint will be restored into the run: a disk tier's first
      generation is not written (`dos_jax.restoring_state`).

  Raises:
    ConfigError: the config does not fit the machine or the files (names the key).
  """
  mesh = check_mesh(cfg, devices)
  dataset_dir = dataset_dir_for(cfg.data)
  check_dataset(cfg, dataset_dir)
  if cfg.mesh.pipeline > 1:
    from dos_jax.train import pipeline_run  # pylint: disable=import-outside-toplevel
    if tx is not None:
      raise ValueError('a pipelined run builds one optimizer per stage from the config')
    return pipeline_run.build(cfg, devices=devices, dataset_dir=dataset_dir)
  if from_hf is None:
    from_hf = cfg.model.from_hf is not None and not ckpt_lib.has_checkpoint(cfg.checkpoint_dir)
  if from_hf:
    apply = model_lib.make_apply(cfg.model)
    params, param_shardings = hf_params(cfg, mesh)
  else:
    apply, params = model_lib.build_model(cfg.model, cfg.train.seed)
    param_shardings = mesh_lib.param_shardings(mesh, params)
    params = jax.device_put(params, param_shardings)
  if mesh.size > 1:  # cuDNN's attention needs q, k and v sharded alike on the mesh
    apply = model_lib.make_apply(cfg.model, mesh)
  with dos_jax.restoring_state() if restoring else contextlib.nullcontext():
    built = optimizer_lib.build_optimizer(cfg, mesh, params, tx=tx)
  tx, opt_state = built.tx, built.opt_state
  state_shardings = step_lib.state_shardings(opt_state, mesh)
  compiler_options = step_lib.compiler_options_for(mesh.devices.flat[0].platform)
  # Commit every leaf (init may leave scalars uncommitted): the update's outputs are
  # committed, and a committed/uncommitted mismatch would recompile at step 2.
  opt_state = jax.device_put(opt_state, state_shardings)
  return Trainer(
      cfg=cfg,
      mesh=mesh,
      dataset_dir=dataset_dir,
      apply=apply,
      tx=tx,
      params=params,
      opt_state=opt_state,
      param_shardings=param_shardings,
      state_shardings=state_shardings,
      batch_sharding=mesh_lib.batch_sharding(mesh),
      train_step=step_lib.make_train_step(
          apply, model_lib.loss_fn, tx, clip_norm=cfg.optim.clip_norm,
          param_shardings=param_shardings, state_shardings=state_shardings,
          compiler_options=compiler_options, early_windows=compiler_options is not None,
      ),
      grad_step=step_lib.make_grad_step(
          apply, model_lib.loss_fn, clip_norm=cfg.optim.clip_norm,
          scale_in_update=step_lib.scales_in_update(tx), grad_shardings=param_shardings,
      ),
      update_step=step_lib.make_update_step(
          tx, param_shardings=param_shardings, state_shardings=state_shardings,
          compiler_options=compiler_options,
      ),
      eval_step=step_lib.make_eval_step(apply, model_lib.loss_fn),
      started_from_hf=from_hf,
  )
