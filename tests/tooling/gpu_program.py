"""The runner's step as a GPU would run it, built and compiled on any machine.

`build_step` builds the runner's one-program step (`step.make_train_step`: forward,
backward, global norm, the dos_jax update with the clip factor as `grad_scale`, apply)
from a `RunConfig` as `trainer.build` does: the same mesh, param placement and
shardings, and the optimizer, state and early host calls from the one builder
(`optimizer.build_optimizer`), with the two-memory program (`Program.TWO_MEMORIES`)
chosen as on a GPU (without one, its early host calls chosen for an H100 node,
`COMPILED_FOR`). No dataset is read (the batch is a token array of the configured
shape). Over several devices, or with `abstract`, the arguments are abstract
(`jax.ShapeDtypeStruct`s with their shardings and memory kinds, the state's from
`dos_jax.abstract_state`): nothing is allocated, so a 20B-parameter step can be built on
a machine with a fraction of its memory.

`compile_step` compiles it for a GPU target with the options the runner uses on a GPU
(`step.compiler_options_for('gpu')`), via `dos_jax.dataflow.compile_for_gpu`: the
scheduled program, its memory and the schedule facts, with no GPU present.
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
from dos_jax.planner import hardware
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.train import model as model_lib
from dos_jax.train import optimizer as optimizer_lib
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig


# The machine a step built without a GPU is chosen for (its early host calls: the cost
# model's for this profile): one GPU of an H100 node, the machine the step is compiled
# for. This machine's own calibration (a CPU's) would make the program, and what the
# compiled tests see, depend on whichever CPU builds it.
COMPILED_FOR = hardware.H100_PCIE_GEN5_NODE


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


def attention_for(cfg: RunConfig, platform: str = 'gpu') -> str:
  """`cfg.model.attention` resolved for a program built for `platform`: 'auto' as on
  that platform, but XLA's attention for a GPU program compiled here with no GPU where
  the plugin cannot compile cuDNN's (`compile.cudnn_compiles_here`). An explicit 'cudnn'
  is kept (its compile then fails with the plugin's reason)."""
  attention = cfg.model.attention_impl(platform)
  if (cfg.model.attention == 'auto' and attention == 'cudnn' and platform == 'gpu'
      and jax.default_backend() != 'gpu' and not compile_lib.cudnn_compiles_here()[0]):
    return 'xla'
  return attention


def build_step(cfg: RunConfig, devices=None, compiler_options: Any = None,
               platform: str = 'gpu', *, abstract: bool | None = None,
               profile: HardwareProfile | None = None) -> StepProgram:
  """The runner's fused step for `cfg` on `devices` (default: one), as the accelerator
  program, with arguments (`model.attention: auto` resolved as on `platform`, a GPU by
  default). `abstract` (default: over several devices) builds abstract arguments;
  `profile`: the machine the early host calls are chosen for (default: on a GPU process
  0's calibrated one, as the runner; elsewhere the GPU node compiled for,
  `COMPILED_FOR`, not this machine's CPU). The step is jitted with `compiler_options`
  and traced told them (`step.told_options`); None: lower it inside
  `dos_jax.compiled_with(options)` of the options it is compiled with (`compile_step`
  does), else it is traced for XLA's default limit on asynchronous calls."""
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, attention=attention_for(cfg, platform)))
  devices = list(jax.devices()[:1] if devices is None else devices)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices)
  mesh_lib.check_divisible(mesh, cfg.data.batch_size)
  abstract = mesh.size > 1 if abstract is None else abstract
  apply, params = _params(cfg, mesh, abstract)
  param_shardings = mesh_lib.param_shardings(mesh, params)
  if abstract:
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          params, param_shardings)
  else:
    params = jax.device_put(params, param_shardings)
  if profile is None and platform == 'gpu' and jax.default_backend() != 'gpu':
    profile = COMPILED_FOR
  built = optimizer_lib.build_optimizer(
      cfg, mesh, params, platform=dos_jax.Program.TWO_MEMORIES if platform == 'gpu' else None,
      abstract=abstract, profile=profile)
  state_shardings = step_lib.state_shardings(built.opt_state, mesh)
  step = step_lib.make_train_step(
      apply, model_lib.loss_fn, built.tx, clip_norm=cfg.optim.clip_norm,
      param_shardings=param_shardings, state_shardings=state_shardings,
      compiler_options=compiler_options)
  shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
  tokens = (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
            if abstract else jax.device_put(jnp.zeros(shape, jnp.int32),
                                            mesh_lib.batch_sharding(mesh)))
  return StepProgram(step=step.jitted, params=params, opt_state=built.opt_state,
                     tokens=tokens)


def _params(cfg: RunConfig, mesh, abstract: bool):
  """The model's apply and its params (shapes only with `abstract`), as `trainer.build`
  makes them."""
  if abstract:
    apply = model_lib.make_apply(cfg.model)
    params = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  else:
    apply, params = model_lib.build_model(cfg.model, cfg.train.seed)
  if mesh.size > 1:  # cuDNN's attention needs q, k and v sharded alike on the mesh
    apply = model_lib.make_apply(cfg.model, mesh)
  return apply, params


def compile_step(cfg: RunConfig, target: dataflow.GpuTarget | str = 'h100_sxm',
                 compiler_options: Any = None, thunks: bool = False,
                 early_windows: bool = True, devices=None,
                 profile: HardwareProfile | None = None) -> dataflow.CompiledGpuProgram:
  """The runner's step for `cfg` on `devices` (default: one) compiled for `target` (no
  GPU needed; see the module docstring); over several devices, one SPMD partition each
  (the result's HLO and memory are one device's).

  `compiler_options` default to the runner's on a GPU; `thunks`: also read what the GPU
  runs (`dataflow.thunks`); `early_windows`: the early host calls' profiled latency, as
  the runner compiles on a GPU (`dataflow.early_windows`); `profile` as in `build_step`.
  """
  options = step_lib.compiler_options_for('gpu') if compiler_options is None \
      else compiler_options
  native = compile_lib.prepare(target)  # before tracing: the kernel goes in host regions
  program = build_step(cfg, devices, profile=profile)
  with dos_jax.compiled_with(options):  # the step traced told their limit
    lowered = dataflow.lower_for_gpu(
        program.step, program.params, program.opt_state, program.tokens,
        target=dataflow.GpuTarget.parse(target), kwargs={'plan': None})
  return compile_lib.compile_lowered(lowered, target, options, native_host_kernel=native,
                                     thunks=thunks, early_windows=early_windows)
