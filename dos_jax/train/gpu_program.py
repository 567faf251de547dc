"""The runner's step as a GPU would run it, built and compiled on any machine.

`compile_step` builds the runner's one-program step (`step.make_train_step`: forward,
backward, global norm, the dos_jax update with the clip factor as `grad_scale`, apply)
from a `RunConfig` exactly as `trainer.build` does, except that the optimizer builds
the accelerator program (`Platform.GPU`) and no dataset is read (the batch is a token
array of the configured shape). It is then compiled for a GPU target with the options
the runner uses on a GPU (`step.compiler_options_for('gpu')`), via
`dos_jax.dataflow.compile_for_gpu`: the scheduled program, its memory and the schedule
facts, with no GPU present.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

import dos_jax
from dos_jax import dataflow
from dos_jax.dataflow import compile as compile_lib
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


def build_step(cfg: RunConfig, compiler_options: Any = None) -> StepProgram:
  """The runner's fused step for `cfg`, as the accelerator program, with arguments
  (`model.attention: auto` resolved as on a GPU)."""
  model_cfg = dataclasses.replace(cfg.model, attention=cfg.model.attention_impl('gpu'))
  apply, params = model_lib.build_model(model_cfg, cfg.train.seed)
  tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps,
                               platform=dos_jax.Platform.GPU)
  opt_state = tx.init(params)
  step = step_lib.make_train_step(
      apply, model_lib.loss_fn, tx, clip_norm=cfg.optim.clip_norm,
      compiler_options=compiler_options)
  tokens = jnp.zeros((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
  return StepProgram(step=step.jitted, params=params, opt_state=opt_state, tokens=tokens)


def compile_step(cfg: RunConfig, target: dataflow.GpuTarget | str = 'h100_sxm',
                 compiler_options: Any = None) -> dataflow.CompiledGpuProgram:
  """The runner's step for `cfg` compiled for `target` (no GPU needed; see module doc).

  `compiler_options` default to the runner's on a GPU.
  """
  options = step_lib.compiler_options_for('gpu') if compiler_options is None \
      else compiler_options
  native = compile_lib.prepare(target)  # before tracing: the kernel goes in host regions
  program = build_step(cfg)
  lowered = dataflow.lower_for_gpu(
      program.step, program.params, program.opt_state, program.tokens,
      target=dataflow.GpuTarget.parse(target), kwargs={'plan': None})
  return compile_lib.compile_lowered(lowered, target, options, native_host_kernel=native)
