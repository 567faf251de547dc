"""One builder: what `dos-jax train` runs on a GPU is what is compiled and timed.

`trainer.build` (the run), `gpu_program.build_step` (`experiments/compile_gpu.py`,
`gpu_check.sh`, the compiled tests) take the optimizer, its state and the early host
calls from `optimizer.build_optimizer`. These tests build the step for the runner's
GPU configs both ways, with one injected hardware profile, and compare the offload, the
plan and the host calls; and check that the runner goes through the builder.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import dos_jax
from dos_jax.planner import costmodel
from dos_jax.planner import timeline
from dos_jax.train import config as config_lib
from tests.tooling import gpu_program
from dos_jax.train import mesh as mesh_lib
from dos_jax.train import model as model_lib
from dos_jax.train import optimizer as optimizer_lib
from dos_jax.train import trainer as trainer_lib

PROFILE = costmodel.PROFILE_PRESETS['h100-pcie5']


def _config(name: str, layers: int) -> config_lib.RunConfig:
  # Fewer layers than the preset: the same widths and subgroup size, a faster build.
  return config_lib.load(f'configs/{name}.yaml', [f'model.n_layers={layers}'])


def _runner_state(cfg: config_lib.RunConfig) -> dos_jax.OffloadedState:
  """The state as `trainer.build` makes it on one GPU: its mesh and param placement,
  then the one builder for the two-memory program."""
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(cfg.model, attention=cfg.model.attention_impl('gpu')))
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg.model, 0))
  shardings = mesh_lib.param_shardings(mesh, shapes)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)
  built = optimizer_lib.build_optimizer(cfg, mesh, params, abstract=True, profile=PROFILE,
                                        platform=dos_jax.Program.TWO_MEMORIES)
  return _state(built.opt_state)


def _state(opt_state) -> dos_jax.OffloadedState:
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  assert len(found) == 1
  return found[0]


@pytest.mark.parametrize('name,layers', [('125m', 12), ('7b-1gpu', 4)])
def test_compile_gpu_builds_the_runners_step(name, layers):
  cfg = _config(name, layers)
  compiled = gpu_program.build_step(cfg, abstract=True, profile=PROFILE).offloaded_state
  runner = _runner_state(cfg)
  assert compiled.partition == runner.partition  # plan, stream order, buffers, host calls
  assert compiled.layout == runner.layout
  assert compiled.partition.two_memories
  # The host calls are the cost model's for this profile and the run's backward pass.
  chooser = timeline.EarlyChooser(PROFILE, backward_seconds=optimizer_lib.backward_seconds(
      cfg, 1))
  plan = compiled.partition.plan
  assert compiled.partition.early == chooser.early_calls(compiled.layout.spec(), plan)


def test_the_runners_steps_are_traced_told_the_options_they_are_compiled_with():
  """The runner compiles the two-memory program with `compiler_options_for('gpu')`;
  its steps (fused and update) are traced told that options' limit on asynchronous
  calls, so both stream lanes join the host call's group (`lanes.grouped_lanes`).
  Compiled with jax's defaults, a step reads what an enclosing `compiled_with` says
  (`gpu_program.compile_step` lowers it inside one)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from dos_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  options = step_lib.compiler_options_for('gpu')
  limit = options['xla_gpu_experimental_parallel_async_compute_limit']
  assert limit >= 3
  seen = []

  def update(grads, state, params=None):
    del params
    seen.append(dos_jax.compiled_limit())
    return grads, state

  tx = optax.GradientTransformation(lambda params: (), update)
  loss_fn = lambda apply, p, tokens: (jnp.sum(p['w'] * tokens.sum()), {})
  params, tokens = {'w': jnp.ones(2)}, jnp.ones((1, 2))
  for compiler_options, told in ((options, limit), (None, None)):
    seen.clear()
    fused = step_lib.make_train_step(None, loss_fn, tx, clip_norm=None,
                                     compiler_options=compiler_options)
    fused.jitted.trace(params, (), tokens, plan=None)
    split = step_lib.make_update_step(tx, compiler_options=compiler_options)
    split.jitted.trace(params, (), params, None, plan=None)
    assert seen == [told, told]
  seen.clear()
  with dos_jax.compiled_with(options):
    step_lib.make_update_step(tx).jitted.trace(params, (), params, None, plan=None)
  assert seen == [limit]


def test_the_runner_builds_through_the_one_builder(monkeypatch, tmp_path):
  calls = []
  real = optimizer_lib.build_optimizer

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(optimizer_lib, 'build_optimizer', spy)
  cfg = config_lib.load(None, ['train.steps=2', f'train.out_dir={tmp_path}/run',
                               'offload.policy=stride', 'offload.platform=gpu'])
  trainer = trainer_lib.build(cfg, devices=jax.devices()[:1])
  assert len(calls) == 1
  state = _state(trainer.opt_state)
  assert state.partition.two_memories  # offload.platform=gpu: the two-memory program
  assert state.partition.early == dos_jax.geometry.partition.early_host_calls(
      len(state.partition.host))  # on a CPU backend: the fixed rule
