"""A `Trainer`: the model, mesh, optimizer and jitted step functions of one run.

`build` does everything that can fail on the user's input (mesh sizes, dataset path,
tensor splits) and writes nothing, so the loop can check a run before creating its
directory. The loop, the tests and the benchmark all drive training through
`Trainer.step`, so they measure and compare the same code.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
import optax

from dos_jax.train import data as data_lib
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Host-side results of one step.

  Attributes:
    loss: training loss of the batch (before the update).
    grad_norm: global L2 norm of the gradients before clipping.
    grad_s: wall time of forward + backward + norm + clip.
    update_s: wall time of the optimizer update (the phase dos_jax offloads).
  """

  loss: float
  grad_norm: float
  grad_s: float
  update_s: float

  @property
  def step_s(self) -> float:
    return self.grad_s + self.update_s


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
  grad_step: Any
  update_step: Any
  eval_step: Any

  def place_batch(self, tokens_BxLp1: np.ndarray) -> jax.Array:
    return jax.device_put(tokens_BxLp1, self.batch_sharding)

  def step(self, tokens_BxLp1: np.ndarray, plan: Any = None) -> StepResult:
    """One optimizer step on a host batch; blocks so each phase is timed on its own."""
    tokens = self.place_batch(tokens_BxLp1)
    t0 = time.perf_counter()
    grads, stats = self.grad_step(self.params, tokens)
    jax.block_until_ready(grads)
    t1 = time.perf_counter()
    self.params, self.opt_state = self.update_step(self.params, self.opt_state, grads, plan=plan)
    jax.block_until_ready((self.params, self.opt_state))
    t2 = time.perf_counter()
    return StepResult(
        loss=float(stats['loss']), grad_norm=float(stats['grad_norm']),
        grad_s=t1 - t0, update_s=t2 - t1,
    )

  def set_state(self, params: Any, opt_state: Any) -> None:
    """Adopts restored state, committed to this run's shardings (no recompile)."""
    self.params = jax.device_put(params, self.param_shardings)
    self.opt_state = jax.device_put(opt_state, self.state_shardings)

  def evaluate(self, num_batches: int) -> float:
    """Mean loss over the first `num_batches` validation batches (the same every time)."""
    sampler = data_lib.BatchSampler(
        self.dataset_dir, 'val', self.cfg.data.batch_size, self.cfg.data.seq_len,
        self.cfg.data.seed,
    )
    total = 0.0
    for _ in range(num_batches):
      total += float(self.eval_step(self.params, self.place_batch(next(sampler))))
    return total / num_batches

  def train_sampler(self) -> Any:
    return data_lib.BatchSampler(
        self.dataset_dir, 'train', self.cfg.data.batch_size, self.cfg.data.seq_len,
        self.cfg.data.seed,
    )

  def compile_counts(self) -> dict[str, int]:
    """Compiled variants of each jitted phase (stays 1 per plan across steps)."""
    return {
        'grad': self.grad_step._cache_size(),  # pylint: disable=protected-access
        'update': self.update_step.jitted._cache_size(),  # pylint: disable=protected-access
    }


def dataset_dir_for(cfg: data_lib.DataConfig) -> str:
  """The prepared dataset to train on: `data.path`, or the default corpus (prepared
  once into a cache directory on first use, never into the run directory)."""
  try:
    return str(data_lib.resolve_dataset(cfg))
  except ValueError as err:
    raise ConfigError(f'data.path: {err}') from None


def build(
    cfg: RunConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    tx: optax.GradientTransformation | None = None,
) -> Trainer:
  """Assembles a run from its config, writing nothing.

  Args:
    cfg: the run config.
    devices: devices of the mesh (default: all).
    tx: an optimizer to use instead of the configured dos_jax AdamW (the tests and the
      benchmark pass `optax.adamw` here as the reference).

  Raises:
    ConfigError: the config does not fit the machine or the files (names the key).
  """
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  mesh_lib.check_divisible(mesh, cfg.data.batch_size)
  dataset_dir = dataset_dir_for(cfg.data)
  apply, params = model_lib.build_model(cfg.model, cfg.train.seed)
  param_shardings = mesh_lib.param_shardings(mesh, params)
  params = jax.device_put(params, param_shardings)
  if tx is None:
    tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps)
  opt_state = tx.init(params)
  state_shardings = step_lib.state_shardings(opt_state, mesh)
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
      grad_step=step_lib.make_grad_step(
          apply, model_lib.loss_fn, clip_norm=cfg.optim.clip_norm,
          grad_shardings=param_shardings,
      ),
      update_step=step_lib.make_update_step(
          tx, param_shardings=param_shardings, state_shardings=state_shardings
      ),
      eval_step=step_lib.make_eval_step(apply, model_lib.loss_fn),
  )
