"""The runner's step as a GPU would run it, built and compiled on any machine.

`compile_step` builds the runner's one-program step (`step.make_train_step`: forward,
backward, global norm, the dos_jax update with the clip factor as `grad_scale`, apply)
from a `RunConfig` exactly as `trainer.build` does, except that the optimizer builds the
accelerator program (`Program.TWO_MEMORIES`) and no dataset is read (the batch is a
token array of the configured shape). It is then compiled for a GPU target with the
options the runner uses on a GPU (`step.compiler_options_for('gpu')`), via
`dos_jax.dataflow.compile_for_gpu`: the scheduled program, its memory and the schedule
facts, with no GPU present.

`build_sharded_step` / `compile_sharded_step` do the same over the config's mesh of
several devices (ZeRO-3 over `fsdp` included) with abstract arguments
(`jax.ShapeDtypeStruct`s with their shardings and memory kinds, the state's from
`dos_jax.abstract_state`): nothing is allocated, so a 20B-parameter step can be built on
a machine with a fraction of its memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import dos_jax
from dos_jax import dataflow
from dos_jax.dataflow import compile as compile_lib
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """The runner's step, built for the GPU: the jitted step and its example arguments."""

  step: Any  # the jitted (params, opt_state, tokens, plan) step
  params: Any
  opt_state: Any
  tokens: Any

  @property
  def offloaded_state(self) -> dos_jax.OffloadedState | None:
    found = [x for x in _flatten_states(self.opt_state)]
    return found[0] if found else None


def _flatten_states(opt_state: Any):
  import jax  # pylint: disable=import-outside-toplevel
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def build_step(cfg: RunConfig, compiler_options: Any = None,
               platform: str = 'gpu') -> StepProgram:
  """The runner's fused step for `cfg`, as the accelerator program, with arguments
  (`model.attention: auto` resolved as on `platform`, a GPU by default)."""
  model_cfg = dataclasses.replace(cfg.model, attention=cfg.model.attention_impl(platform))
  apply, params = model_lib.build_model(model_cfg, cfg.train.seed)
  tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps,
                               platform=dos_jax.Program.TWO_MEMORIES)
  opt_state = tx.init(params)
  step = step_lib.make_train_step(
      apply, model_lib.loss_fn, tx, clip_norm=cfg.optim.clip_norm,
      compiler_options=compiler_options)
  tokens = jnp.zeros((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
  return StepProgram(step=step.jitted, params=params, opt_state=opt_state, tokens=tokens)


def compile_step(cfg: RunConfig, target: dataflow.GpuTarget | str = 'h100_sxm',
                 compiler_options: Any = None, thunks: bool = False,
                 early_windows: bool = True) -> dataflow.CompiledGpuProgram:
  """The runner's step for `cfg` compiled for `target` (no GPU needed; see module doc).

  `compiler_options` default to the runner's on a GPU; `thunks`: also read what the GPU
  runs (`dataflow.thunks`); `early_windows`: the early host calls' profiled latency, as
  the runner compiles on a GPU (`dataflow.early_windows`).
  """
  options = step_lib.compiler_options_for('gpu') if compiler_options is None \
      else compiler_options
  native = compile_lib.prepare(target)  # before tracing: the kernel goes in host regions
  program = build_step(cfg)
  lowered = dataflow.lower_for_gpu(
      program.step, program.params, program.opt_state, program.tokens,
      target=dataflow.GpuTarget.parse(target), kwargs={'plan': None})
  return compile_lib.compile_lowered(lowered, target, options, native_host_kernel=native,
                                     thunks=thunks, early_windows=early_windows)


def _gpu_model(cfg: RunConfig) -> model_lib.ModelConfig:
  return dataclasses.replace(cfg.model, attention=cfg.model.attention_impl('gpu'))


def build_sharded_step(cfg: RunConfig, devices, compiler_options: Any = None) -> StepProgram:
  """The runner's fused step for `cfg` over its mesh of `devices` (as `trainer.build`
  places it: the sharding table, ZeRO-3 over `fsdp`, the state over `mesh.state_axis`), as
  the accelerator program, with abstract arguments: nothing is allocated."""
  model_cfg = _gpu_model(cfg)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  mesh_lib.check_divisible(mesh, cfg.data.batch_size)
  apply = model_lib.make_apply(model_cfg, mesh)
  shapes = jax.eval_shape(lambda: model_lib.init_params(model_cfg, 0))
  param_shardings = mesh_lib.param_shardings(mesh, shapes)
  params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        shapes, param_shardings)
  tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps,
                               platform=dos_jax.Program.TWO_MEMORIES,
                               data_axis=mesh_lib.state_axis(mesh),
                               shard_dims=mesh_lib.state_shard_dims(mesh))
  opt_state = dos_jax.abstract_state(tx, params)
  state_shardings = step_lib.state_shardings(opt_state, mesh)
  step = step_lib.make_train_step(
      apply, model_lib.loss_fn, tx, clip_norm=cfg.optim.clip_norm,
      param_shardings=param_shardings, state_shardings=state_shardings,
      compiler_options=compiler_options)
  tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32,
                                sharding=mesh_lib.batch_sharding(mesh))
  return StepProgram(step=step.jitted, params=params, opt_state=opt_state, tokens=tokens)


def compile_sharded_step(cfg: RunConfig, devices, target: dataflow.GpuTarget | str = 'h100_sxm',
                         compiler_options: Any = None, early_windows: bool = True
                         ) -> dataflow.CompiledGpuProgram:
  """`build_sharded_step` compiled for `len(devices)` GPUs of `target`, one SPMD
  partition each (the result's HLO and memory are one device's); `early_windows` as
  in `compile_step`."""
  options = step_lib.compiler_options_for('gpu') if compiler_options is None \
      else compiler_options
  native = compile_lib.prepare(target)
  program = build_sharded_step(cfg, devices)
  lowered = dataflow.lower_for_gpu(
      program.step, program.params, program.opt_state, program.tokens,
      target=dataflow.GpuTarget.parse(target), kwargs={'plan': None})
  return compile_lib.compile_lowered(lowered, target, options, native_host_kernel=native,
                                     early_windows=early_windows)
