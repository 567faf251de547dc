"""The run's optimizer and its state, built one way for every caller.

`build_optimizer` is the one builder: `trainer.build` (the run), `tests/tooling/gpu_program` (the step
compiled for a GPU target without one: `experiments/compile_gpu.py`, `gpu_check.sh` and
the compiled tests) all take their optimizer, state and early host calls from it, so
what is compiled and timed is what the runner runs.

What it decides for the user (nothing here is a config key):
* `Auto`'s device-memory budget and backward-pass estimate (`budget_auto`);
* the two-memory program's early host calls (`Partition.early`): `Auto` chooses its
  own at `init`; for a fixed policy, on a GPU target, the cost model chooses them for the
  plan (`timeline.EarlyChooser` with process 0's profile: every process the same),
  elsewhere the state keeps the fixed rule its `init` took;
* a check that a fixed placement's update phase fits the device memory
  (`check_stream_memory`), before XLA's allocator would fail.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
import optax

import dos_jax
from dos_jax.planner import auto as auto_lib
from dos_jax.planner import memory
from dos_jax.planner import step_memory
from dos_jax.planner import timeline
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.train import agree
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import step as step_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError

# Training TFLOP/s per device that `backward_seconds` assumes: what `dos-jax plan`
# assumes for an H100 (`--achieved-tflops`).
ACHIEVED_TFLOPS = 200.0


@dataclasses.dataclass(frozen=True)
class BuiltOptimizer:
  """The optimizer of a run and its first state."""

  tx: optax.GradientTransformation
  opt_state: Any


def build_optimizer(cfg: RunConfig, mesh: jax.sharding.Mesh, params: Any, *,
                    platform: Any = None, abstract: bool = False,
                    profile: HardwareProfile | None = None,
                    tx: optax.GradientTransformation | None = None) -> BuiltOptimizer:
  """The configured optimizer and its state for `params` on `mesh`.

  Args:
    cfg: the run config.
    mesh: the run's mesh (the state is split over `mesh_lib.state_axis`).
    params: the params, placed (or `jax.ShapeDtypeStruct`s with `abstract`).
    platform: the program to build (a `dos_jax.Program`); None: `offload.platform`,
      else the backend's. `Program.TWO_MEMORIES` is what a GPU runs.
    abstract: the state as `dos_jax.abstract_state` (nothing allocated).
    profile: the machine the cost model chooses the early host calls for; None:
      process 0's calibrated profile (`agree.shared_profile`).
    tx: an optimizer to use instead of the configured one (the tests' reference).
  """
  devices = list(mesh.devices.flat)
  budget_auto(cfg, devices)
  agree.auto(cfg.offload.placement)  # several processes: process 0's profile and plans
  if tx is None:
    tx = step_lib.make_optimizer(cfg.optim, cfg.offload, cfg.train.steps, platform=platform,
                                 data_axis=mesh_lib.state_axis(mesh),
                                 shard_dims=mesh_lib.state_shard_dims(mesh))
  opt_state = dos_jax.abstract_state(tx, params) if abstract else tx.init(params)
  gpu = (platform is dos_jax.Program.TWO_MEMORIES and cfg.offload.platform != 'cpu'
         ) or devices[0].platform != 'cpu'
  if gpu:
    opt_state = choose_early_calls(cfg, opt_state, len(devices), profile)
  check_stream_memory(cfg, opt_state, devices)
  return BuiltOptimizer(tx=tx, opt_state=opt_state)


def _states(opt_state: Any) -> list[dos_jax.OffloadedState]:
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def choose_early_calls(cfg: RunConfig, opt_state: Any, num_devices: int,
                       profile: HardwareProfile | None = None) -> Any:
  """`opt_state` with the early host calls the cost model chooses for a fixed policy's
  plan (`timeline.EarlyChooser`; `Auto` chose its own at `init`), moved in with
  `dos_jax.migrate` (the static state changes, no row moves)."""
  placement = cfg.offload.placement
  if placement is None or isinstance(placement, dos_jax.AdaptivePolicy):
    return opt_state
  chooser = timeline.EarlyChooser(
      profile if profile is not None else agree.shared_profile(),
      backward_seconds=backward_seconds(cfg, num_devices))
  for state in _states(opt_state):
    if state.partition.two_memories:
      plan = state.partition.plan
      opt_state = dos_jax.migrate(opt_state, plan,
                                  early=chooser.early_calls(state.layout.spec(), plan))
  return opt_state


# Steps between two choices of the early host calls at the measured clip rate: each
# change retraces and compiles the step once (`replan_early`).
REPLAN_EVERY = 200


def speculates(opt_state: Any) -> bool:
  """Whether a step of `opt_state` has early host calls, which speculate on the clip
  factor (the two-memory program, with two host subgroups or more)."""
  return any(state.partition.early for state in _states(opt_state))


def early_for(cfg: RunConfig, opt_state: Any, plan: dos_jax.Plan) -> tuple[int, ...] | None:
  """The early host calls `Auto` chooses for its new `plan` (None: keep the state's
  where its tiers stay, else the fixed rule; what `dos_jax.migrate` takes)."""
  placement, states = cfg.offload.placement, _states(opt_state)
  if not isinstance(placement, dos_jax.Auto) or not states:
    return None
  if states[0].partition.plan == plan:
    return None
  return placement.early_calls(states[0].layout.spec(), plan)


def replan_early(cfg: RunConfig, opt_state: Any, num_devices: int, rollbacks: int,
                 steps: int, profile: HardwareProfile | None = None) -> Any:
  """`opt_state` with its early host calls chosen again at the clip rate measured over
  `steps` steps (`rollbacks` of them had a clip factor other than 1; the counts are
  reduced over the processes by their maximum first). A change is a `dos_jax.migrate`
  of the static state: the next step is traced and compiled again, once."""
  rollbacks, steps = agree.max_counts(rollbacks, steps)
  rate = min(1.0, rollbacks / steps) if steps > 0 else 0.0
  placement = cfg.offload.placement
  if isinstance(placement, dos_jax.Auto):
    placement.observe_rollbacks(rollbacks, steps)
    choose = placement.early_calls
  else:
    choose = timeline.EarlyChooser(
        profile if profile is not None else agree.shared_profile(),
        backward_seconds=backward_seconds(cfg, num_devices), clip_rate=rate).early_calls
  for state in _states(opt_state):
    if state.partition.two_memories:
      plan = state.partition.plan
      early = choose(state.layout.spec(), plan)
      if early is not None:
        opt_state = dos_jax.migrate(opt_state, plan, early=tuple(early))
  return opt_state


def budget_auto(cfg: RunConfig, devices: Sequence[jax.Device],
                device_bytes: float | None = None) -> None:
  """Gives the configured `Auto` the device memory it may fill beside the model, from
  the same sizing as the up-front memory check, so that it also weighs keeping
  subgroups resident in device memory (without a budget it only streams or updates on
  the host). No-op for other policies and on the CPU backend."""
  auto = cfg.offload.placement
  if not isinstance(auto, dos_jax.Auto) or auto.budget_bytes is not None:
    return
  budget = memory.run_budget(cfg, devices, device_bytes)
  if budget is not None:
    auto.budget_bytes, auto.activation_bytes = budget
    if not auto.backward_seconds:  # what early host calls can hide behind
      auto.backward_seconds = backward_seconds(cfg, len(devices))
    if not auto.last_grad_bytes:  # as `dos-jax plan` gives it: the same ranking
      shape = cfg.model.shape()
      auto.last_grad_bytes = auto_lib.last_grad_bytes(
          shape.vocab_size, shape.dim, jax.numpy.dtype(cfg.model.param_dtype).itemsize,
          len(devices))


def check_stream_memory(cfg: RunConfig, opt_state: Any, devices: Sequence[jax.Device],
                        device_bytes: float | None = None) -> None:
  """Raises `ConfigError` naming `offload.policy` when a fixed placement's update phase
  does not fit the device memory beside the model (`step_memory.stream_shortfall`, with
  the stream regions the state's step builds), before XLA's allocator would fail.
  `Auto` sizes its own (`budget_auto`); on the CPU backend nothing is checked.
  `device_bytes`: the device memory to assume (default: what the device reports)."""
  if cfg.offload.placement is None or isinstance(cfg.offload.placement,
                                                 dos_jax.AdaptivePolicy):
    return
  for state in _states(opt_state):
    line = step_memory.stream_shortfall(cfg, state.partition.plan, devices,
                                        device_bytes=device_bytes,
                                        regions=dos_jax.stream_regions(state))
    if line is not None:
      raise ConfigError(line)


def backward_seconds(cfg: RunConfig, num_devices: int) -> float:
  """The backward pass of one step per device, estimated as 4 FLOPs per param and token
  at `ACHIEVED_TFLOPS`."""
  abstract = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  tokens = cfg.data.batch_size * cfg.data.seq_len / max(1, num_devices)
  return 4 * params * tokens / (ACHIEVED_TFLOPS * 1e12)
