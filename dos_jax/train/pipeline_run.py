"""A pipelined run (`mesh.pipeline > 1`): the `Trainer` interface over S stages.

One program computes the loss and every gradient through the GPipe schedule
(`dos_jax.train.pipeline`) on the whole mesh, with the global gradient norm and clip
factor. Then each stage runs its own dos_jax update program on its own devices: stage s
has its own optimizer, whose plan comes from its own layout and whose state lives in
host memory sharded over that stage's `data` axis (so the state is split over
`pipeline` by construction and over `data` by dos_jax). A stage's params and gradients
reach its update as views of the whole-mesh arrays (no copy); the updated blocks are
joined back without a copy; the embedding (first stage's) and the final norm and head
(last stage's) are copied to the other stages, the one transfer per step the split adds.

To the loop and the checkpoints this looks like any run: `params` is the canonical tree
and `opt_state.to_trees()` the canonical optimizer trees, so a checkpoint restores under
any pipeline shape (or none).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dos_jax
from dos_jax.train import data as data_lib
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import pipeline as pipe
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError
from dos_jax.train.results import StepResult


def _is_subtree(treedef):
  return lambda x: isinstance(x, dict) and jax.tree.structure(x) == treedef


@dataclasses.dataclass
class StagedState:
  """Every stage's optimizer state, stage by stage."""

  states: list[Any]
  shape: pipe.Shape
  stage_treedefs: list[Any]

  def to_trees(self) -> Any:
    """The canonical layout-independent trees (as `dos_jax.state_to_pytrees` of an
    unpipelined run), each leaf where its stage keeps it."""
    flat, outer = [], None
    for state, treedef in zip(self.states, self.stage_treedefs):
      trees = dos_jax.state_to_pytrees(state, None)
      leaves, outer_s = jax.tree.flatten(trees, is_leaf=_is_subtree(treedef))
      flat.append((leaves, treedef))
      outer = outer or outer_s
    merged = []
    for i, first in enumerate(flat[0][0]):
      if _is_subtree(flat[0][1])(first):
        merged.append(pipe.stage_to_canonical([f[0][i] for f in flat], self.shape))
      else:  # A scalar (the step count): the same on every stage.
        merged.append(first)
    return outer.unflatten(merged)


@dataclasses.dataclass
class StagedOptimizer:
  """The stages' optimizers; restores a `StagedState` from canonical trees."""

  txs: list[Any]
  shape: pipe.Shape
  shardings: list[Any]  # Each stage's param shardings.

  def state_from_trees(self, trees: Any, canonical_params: Any) -> StagedState:
    treedef = jax.tree.structure(canonical_params)
    leaves, outer = jax.tree.flatten(trees, is_leaf=_is_subtree(treedef))
    split = [pipe.canonical_to_stages(x, self.shape) if _is_subtree(treedef)(x) else None
             for x in leaves]
    params = _place_stages(pipe.canonical_to_stages(canonical_params, self.shape),
                           self.shardings)
    states = []
    for s, tx in enumerate(self.txs):
      # Scalars (the step count) go to every stage: as host values, placed by the rebuild.
      stage_trees = outer.unflatten(
          [np.asarray(x) if parts is None else parts[s] for x, parts in zip(leaves, split)])
      states.append(dos_jax.state_from_pytrees(stage_trees, params[s], tx))
    return StagedState(states, self.shape, [jax.tree.structure(p) for p in params])


def _place_stages(trees: list[Any], shardings: list[Any]) -> list[Any]:
  return [jax.device_put(t, s) for t, s in zip(trees, shardings)]


@dataclasses.dataclass
class PipelineTrainer:
  """The live state of a pipelined run; the same interface as `trainer.Trainer`."""

  cfg: RunConfig
  mesh: jax.sharding.Mesh
  dataset_dir: str
  shape: pipe.Shape
  apply: Any
  tx: StagedOptimizer
  piped: Any  # The pipelined params on the whole mesh.
  staged: StagedState
  specs: Any
  stage_shardings: list[Any]
  batch_sharding: NamedSharding
  grad_step: Any
  update_steps: list[Any]
  eval_step: Any
  from_pipelined: Any

  @property
  def params(self) -> Any:
    """Canonical params (for checkpoints) on the whole mesh."""
    return self.from_pipelined(self.piped)

  @property
  def opt_state(self) -> StagedState:
    return self.staged

  def _stage_params(self, tree: Any) -> list[Any]:
    return [pipe.stage_view(tree, s, sh) for s, sh in enumerate(self.stage_shardings)]

  def place_batch(self, tokens_BxLp1: np.ndarray) -> jax.Array:
    return jax.device_put(tokens_BxLp1, self.batch_sharding)

  def step(self, tokens_BxLp1: np.ndarray, plan: Any = None, *, split: bool = False):
    """One optimizer step: the pipelined gradient program, then every stage's update.
    With `split`, the two phases are timed apart (the update phase spans all stages)."""
    del plan  # Each stage applies its own policy's plan (adaptive ones are refused).
    tokens = self.place_batch(tokens_BxLp1)
    programs = sum(self.compile_counts().values())
    t0 = time.perf_counter()
    grads, grad_scale, stats = self.grad_step(self.piped, tokens)
    grad_s = update_s = None
    if split:
      jax.block_until_ready((grads, grad_scale, stats))
      t1 = time.perf_counter()
    params = self._stage_params(self.piped)
    grad_parts = self._stage_params(grads)
    new_params, new_states = [], []
    for s, update in enumerate(self.update_steps):
      scale = None
      if grad_scale is not None:
        scale = jax.device_put(grad_scale, NamedSharding(pipe.stage_mesh(self.mesh, s), P()))
      p, st = update(params[s], self.staged.states[s], grad_parts[s], scale)
      new_params.append(p)
      new_states.append(st)
    self.staged = dataclasses.replace(self.staged, states=new_states)
    self.piped = pipe.assemble(new_params, self.mesh, self.specs)
    jax.block_until_ready((self.piped, new_states, stats))
    now = time.perf_counter()
    if split:
      grad_s, update_s = t1 - t0, now - t1
    return StepResult(
        loss=float(stats['loss']), grad_norm=float(stats['grad_norm']), step_s=now - t0,
        grad_s=grad_s, update_s=update_s,
        compiled=sum(self.compile_counts().values()) != programs,
    )

  def set_state(self, params: Any, opt_state: StagedState) -> None:
    """Adopts restored canonical params and a `StagedState` (from `tx`)."""
    trees = _place_stages(pipe.canonical_to_stages(params, self.shape), self.stage_shardings)
    self.piped = pipe.assemble(trees, self.mesh, self.specs)
    self.staged = dataclasses.replace(
        opt_state, states=[jax.device_put(st, step_lib.state_shardings(
            st, pipe.stage_mesh(self.mesh, s))) for s, st in enumerate(opt_state.states)])

  def evaluate(self, num_batches: int) -> float:
    sampler = data_lib.sampler_for(self.cfg.data, self.dataset_dir, 'val')
    total = 0.0
    for _ in range(num_batches):
      total += float(self.eval_step(self.piped, self.place_batch(next(sampler))))
    return total / num_batches

  def train_sampler(self) -> Any:
    return data_lib.sampler_for(self.cfg.data, self.dataset_dir, 'train')

  def compile_counts(self) -> dict[str, int]:
    # pylint: disable=protected-access
    counts = {'grad': self.grad_step._cache_size()}
    for s, update in enumerate(self.update_steps):
      counts[f'update/stage{s}'] = update.jitted._cache_size()
    return counts


def _decay_mask(stage_params: Any) -> Any:
  """`step.decay_mask` of the unstacked params: matrices decay, norm scales do not
  (a stacked leaf has two more axes, stage and layer, than the param it holds)."""
  return {k: jax.tree.map(lambda p, k=k: p.ndim - (2 if k == pipe.STAGES else 0) >= 2, v)
          for k, v in stage_params.items()}


def build(cfg: RunConfig, *, devices: Sequence[jax.Device] | None = None,
          dataset_dir: str) -> PipelineTrainer:
  """Assembles a pipelined run, writing nothing.

  Raises:
    ConfigError: the stages, microbatches or policy do not fit (names the key).
  """
  if cfg.offload.policy == 'auto':
    raise ConfigError('offload.policy: auto is not supported with mesh.pipeline > 1;'
                      ' choose a fixed policy (all_host, stride, ...)')
  if jax.process_count() > 1:
    raise ConfigError('mesh.pipeline: pipelined runs are single-process for now'
                      f' ({jax.process_count()} processes joined); use mesh.pipeline=1')
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  mesh_lib.check_divisible(mesh, cfg.data.batch_size)
  shape = pipe.make_shape(cfg.model.shape().n_layers, cfg.mesh.pipeline,
                          cfg.train.microbatches)
  pipe.check_batch(shape, cfg.data.batch_size, mesh.shape['data'])
  canonical = model_lib.init_params(cfg.model, cfg.train.seed)
  mesh_lib.param_shardings(mesh, canonical)  # Checks the tensor splits, naming the key.
  specs = pipe.pipelined_specs(pipe.to_pipelined(canonical, shape))
  stage_shardings = [pipe.stage_shardings(mesh, s, shape.stages, specs)
                     for s in range(shape.stages)]
  params = _place_stages(pipe.canonical_to_stages(canonical, shape), stage_shardings)
  txs, states = [], []
  for s in range(shape.stages):
    tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps, mask=_decay_mask)
    state = tx.init(params[s])
    states.append(jax.device_put(
        state, step_lib.state_shardings(state, pipe.stage_mesh(mesh, s))))
    txs.append(tx)
  apply = pipe.make_apply(cfg.model, mesh, shape)
  piped_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                 is_leaf=lambda x: isinstance(x, P))
  update_steps = [
      step_lib.make_update_step(
          tx, param_shardings=stage_shardings[s],
          state_shardings=step_lib.state_shardings(states[s], pipe.stage_mesh(mesh, s)))
      for s, tx in enumerate(txs)
  ]
  return PipelineTrainer(
      cfg=cfg,
      mesh=mesh,
      dataset_dir=dataset_dir,
      shape=shape,
      apply=apply,
      tx=StagedOptimizer(txs, shape, stage_shardings),
      piped=pipe.assemble(params, mesh, specs),
      staged=StagedState(states, shape, [jax.tree.structure(p) for p in params]),
      specs=specs,
      stage_shardings=stage_shardings,
      batch_sharding=mesh_lib.batch_sharding(mesh),
      grad_step=step_lib.make_grad_step(
          apply, model_lib.loss_fn, clip_norm=cfg.optim.clip_norm,
          scale_in_update=step_lib.scales_in_update(txs[0]), grad_shardings=piped_shardings,
      ),
      update_steps=update_steps,
      eval_step=step_lib.make_eval_step(apply, model_lib.loss_fn),
      from_pipelined=pipe.make_from_pipelined(shape, mesh, specs),
  )
