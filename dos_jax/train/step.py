"""The train step: one jitted program (forward, backward, norm, update, apply), and the
same step split in two programs for timing the update phase.

`make_train_step` is the step the runner runs: the forward and backward passes, the
global gradient norm, the dos_jax update and `optax.apply_updates`, in ONE program,
with params and optimizer state donated (updated in place) and the placement `Plan`
static (each plan compiles once; output shardings are pinned to the inputs', so step
t's outputs are step t+1's inputs without a recompile). One program lets XLA start a
host-bound gradient's copy as soon as the backward pass makes it, instead of after
the whole backward pass (the paper's "gradient flush", docs/design.md's second rule).

Clipping never holds the gradients back. The clip factor (`optax.clip_by_global_norm`'s
`min(1, max_norm / norm)`) needs every gradient; scaling the gradient tree by it would
make each gradient wait for the last one. So for the dos_jax optimizer the factor is
handed to its update as `grad_scale`, applied in fp32 where each subgroup is updated
(host or device), after the gradient has moved. Plain `optax.adamw` (the reference of
the tests and benchmarks) has no `grad_scale`: its gradient tree is scaled first.

Timing the update phase. The cost model's `Auto` policy needs measured update-phase
times, and the metrics report them; inside one program there is no update phase to
time. The two-program form is kept for that: `make_grad_step` (forward, backward, norm,
clip factor) then `make_update_step` (update + apply, donated, plan static), the same
functions the fused step composes, so the math (the `grad_scale` handling included) is
the same and the update program's wall time is the update phase alone. The loop runs
a "split" step only when a time is wanted: on the steps whose metrics it logs (or
every `train.split_every` steps) and whenever the placement policy asks for one
(`Auto.wants_measurement`: while its plan is not yet confirmed by a measurement);
every other step runs fused. Why not estimate the update from the fused step's time
minus a gradient-only time: that needs the gradient program timed anyway, and the
difference of two noisy times is noisier than either. The split step gives up the
overlap of gradient transfers with the backward pass, and its cost is paid only on
the few steps measured; what it measures is the update phase with no gradient copy
hidden, which is the cost model's `update_seconds` with `backward_seconds=0` (the
runner's `Auto()` default). Compiled programs stay bounded: per plan, one fused
program and one update program, plus one gradient program for the run.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

import dos_jax
from dos_jax import compiler_options_for
from dos_jax.dataflow import early_windows as early_windows_lib
from dos_jax.train.config import ConfigError, OffloadConfig, OptimConfig

Params = Any
OptState = Any
Stats = dict[str, jax.Array]


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then cosine decay to `min_lr_ratio * lr` (or flat)."""
  if cfg.schedule == 'constant':
    return optax.warmup_constant_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.lr,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(total_steps, cfg.warmup_steps + 1),
      end_value=cfg.lr * cfg.min_lr_ratio,
  )


def decay_mask(params: Params) -> Any:
  """Weight decay on matrices (embeddings, projections) only, not on norm scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    optim: OptimConfig,
    offload: OffloadConfig | None,
    total_steps: int,
    mask: Callable[[Params], Any] | None = None,
    platform: Any = None,
    data_axis: str = 'data',
    shard_dims: Any = None,
) -> optax.GradientTransformation:
  """AdamW from the config: dos_jax's offloaded one, or plain `optax.adamw` when
  `offload` is None or its policy is 'none' (the baseline: state in device memory).
  `mask` (default `decay_mask`) says which leaves get weight decay. `platform` (a
  `dos_jax.Program`, default the config's, else the backend's) picks the program dos_jax
  builds. `data_axis` is the params' mesh axis that shards the state ('fsdp' for ZeRO-3);
  `shard_dims` (`mesh.state_shard_dims`) packs the two-memory program's state by the
  params' shards, so that each device runs the one construction on its own columns.

  Clipping is not part of the optimizer: the step computes the global norm once (it is
  also reported) and hands the clip factor to the dos_jax update as `grad_scale` (see
  the module docstring), or scales the gradients for `optax.adamw`.
  """
  kwargs = dict(
      learning_rate=make_schedule(optim, total_steps),
      b1=optim.b1,
      b2=optim.b2,
      eps=optim.eps,
      mu_dtype=None if optim.mu_dtype is None else jnp.dtype(optim.mu_dtype),
      weight_decay=optim.weight_decay,
      mask=decay_mask if mask is None else mask,
  )
  if offload is None or offload.placement is None:
    return optax.adamw(**kwargs)
  implementation = make_implementation(offload, platform)
  two_memories = implementation.target() is dos_jax.Program.TWO_MEMORIES
  return dos_jax.adamw(**kwargs, offload=make_offload(offload, data_axis),
                       implementation=implementation,
                       shard_dims=shard_dims if two_memories else None)


def make_offload(cfg: OffloadConfig, data_axis: str = 'data') -> dos_jax.Offload:
  """The `dos_jax.Offload` value for the configured policy, subgroup size and disk
  tier; `data_axis` as in `make_optimizer`."""
  kwargs = {} if cfg.subgroup_size is None else {'subgroup_size': cfg.subgroup_size}
  if cfg.disk_dir is not None:
    cap = None if cfg.host_state_gib is None else int(cfg.host_state_gib * 2**30)
    kwargs['disk'] = dos_jax.Disk(os.path.abspath(cfg.disk_dir), host_state_bytes=cap)
  return dos_jax.Offload(policy=cfg.placement, data_axis=data_axis, **kwargs)


def make_implementation(cfg: OffloadConfig, platform: Any = None) -> dos_jax.Implementation:
  """The `dos_jax.Implementation` of the run: the program `platform` names (a
  `dos_jax.Program`), else the config's `offload.platform`, else the backend's."""
  return dos_jax.Implementation(program=cfg.platform if platform is None else platform)


def clip_by_global_norm(grads: Params, max_norm: float | None) -> tuple[Params, jax.Array]:
  """Scales `grads` so their global L2 norm is at most `max_norm` (as
  `optax.clip_by_global_norm`); returns them and the norm before clipping."""
  if max_norm is None:
    return grads, optax.tree.norm(grads)
  factor, norm = dos_jax.clip_factor(grads, max_norm)
  return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads), norm


def scales_in_update(tx: optax.GradientTransformation) -> bool:
  """Whether `tx` takes the clip factor as `grad_scale` (dos_jax's offloaded transforms
  do; optax's do not, so their gradients are scaled before the update)."""
  return dos_jax.is_offloaded(tx)


def _loss_and_grads(apply: Callable, loss_fn: Callable, params: Params,
                    tokens_BxLp1: jax.Array) -> tuple[Params, Stats]:
  """Forward and backward: the gradients and the scalar metrics (the loss included)."""
  (loss, metrics), grads = jax.value_and_grad(
      lambda p: loss_fn(apply, p, tokens_BxLp1), has_aux=True
  )(params)
  stats = {k: v for k, v in dict(metrics).items() if jnp.ndim(v) == 0}
  stats['loss'] = loss
  return grads, stats


def _clip(grads: Params, clip_norm: float | None,
          scale_in_update: bool) -> tuple[Params, jax.Array | None, jax.Array]:
  """`(grads, grad_scale, norm)`: what the update gets, and the norm before clipping.

  With `scale_in_update` the gradients come back untouched and the clip factor is the
  update's `grad_scale` (None without clipping); otherwise they come back scaled.
  """
  if clip_norm is None or not scale_in_update:
    grads, norm = clip_by_global_norm(grads, clip_norm)
    return grads, None, norm
  factor, norm = dos_jax.clip_factor(grads, clip_norm)
  return grads, factor, norm


def _update(tx: optax.GradientTransformation, params: Params, opt_state: OptState,
            grads: Params, grad_scale: jax.Array | None, plan: Any) -> tuple[Params, OptState]:
  """The optimizer update and `optax.apply_updates`; `plan` and `grad_scale` are passed
  only when set (`optax.adamw` takes neither)."""
  extra = {}
  if plan is not None:
    extra['plan'] = plan
  if grad_scale is not None:
    extra['grad_scale'] = grad_scale
  updates, opt_state = tx.update(grads, opt_state, params, **extra)
  return optax.apply_updates(params, updates), opt_state


def told_options(fn: Callable, compiler_options: Mapping[str, Any] | None) -> Callable:
  """`fn`, traced inside `dos_jax.compiled_with(compiler_options)`: the dos_jax update
  in it reads the limit on asynchronous calls in flight of the options it is compiled
  with. None (jax's defaults): `fn` itself, which reads what an enclosing
  `compiled_with` says (a caller that compiles the lowered step itself), else
  `XLA_FLAGS`, else XLA's 2."""
  if compiler_options is None:
    return fn

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with dos_jax.compiled_with(compiler_options):
      return fn(*args, **kwargs)

  return traced


def _pinned(param_shardings: Any, state_shardings: Any) -> tuple[Any, Any] | None:
  """Output shardings: the inputs', except for a dos_jax state, which the transform
  places itself (memory kinds included) and whose tiers change with the plan."""
  if param_shardings is None or state_shardings is None:
    return None
  is_offloaded = lambda x: isinstance(x, dos_jax.OffloadedState)
  state_shardings = jax.tree.map(lambda x: None if is_offloaded(x) else x, state_shardings,
                                 is_leaf=is_offloaded)
  return param_shardings, state_shardings


def make_train_step(
    apply: Callable,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    clip_norm: float | None,
    param_shardings: Any = None,
    state_shardings: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
    early_windows: bool = False,
) -> Callable[..., tuple[Params, OptState, Stats]]:
  """The one-program step: jitted `(params, opt_state, tokens_BxLp1, plan=None) ->
  (params, opt_state, {'loss', 'grad_norm', ...})`.

  Forward, backward, global norm, update and apply in one program; params and
  optimizer state are donated; `plan` (a hashable `dos_jax.Plan`) is static: one
  compilation per plan. Output shardings are pinned to the inputs' (memory kinds
  included), so step t's outputs are valid inputs of step t+1 without a recompile.
  The clip factor goes to a dos_jax `tx` as `grad_scale` (module docstring).
  `compiler_options` are XLA's (`compiler_options_for` gives the runner's); the step is
  traced told them (`told_options`).
  `early_windows`: compile each plan's program with `dataflow.compile_step`, so that its
  early host calls start as soon as their gradients are in host memory (the runner's
  choice on a GPU); `call.compiles()` counts the programs either way.
  """
  scale_in_update = scales_in_update(tx)

  def train_step(params, opt_state, tokens_BxLp1, plan):
    grads, stats = _loss_and_grads(apply, loss_fn, params, tokens_BxLp1)
    grads, grad_scale, stats['grad_norm'] = _clip(grads, clip_norm, scale_in_update)
    params, opt_state = _update(tx, params, opt_state, grads, grad_scale, plan)
    return params, opt_state, stats

  pinned = _pinned(param_shardings, state_shardings)
  jitted = jax.jit(
      told_options(train_step, compiler_options),
      static_argnames=('plan',),
      donate_argnums=(0, 1),
      out_shardings=None if pinned is None else (*pinned, None),
      compiler_options=None if compiler_options is None else dict(compiler_options),
  )

  programs = {}  # plan -> its compiled program (`early_windows`)

  @functools.wraps(train_step)
  def call(params, opt_state, tokens_BxLp1, plan=None):
    if not early_windows:
      return jitted(params, opt_state, tokens_BxLp1, plan=plan)
    if plan not in programs:
      programs[plan] = early_windows_lib.compile_step(
          jitted.lower(params, opt_state, tokens_BxLp1, plan=plan))
    return programs[plan](params, opt_state, tokens_BxLp1)

  call.jitted = jitted
  # pylint: disable-next=protected-access
  call.compiles = lambda: len(programs) if early_windows else jitted._cache_size()
  return call


def make_grad_step(
    apply: Callable,
    loss_fn: Callable,
    *,
    clip_norm: float | None,
    scale_in_update: bool = False,
    grad_shardings: Any = None,
) -> Callable[[Params, jax.Array], tuple[Params, jax.Array | None, Stats]]:
  """The first program of the split step: jitted `(params, tokens_BxLp1) -> (grads,
  grad_scale, {'loss', 'grad_norm', ...})`.

  With `scale_in_update` (a dos_jax optimizer, see `scales_in_update`) the gradients
  are returned unclipped and `grad_scale` is the clip factor for `make_update_step`, as
  in the fused step; otherwise the gradients are clipped and `grad_scale` is None.
  `grad_shardings` (the params' shardings) pins the gradients' layout so that the
  update step sees the same input shardings every step.
  """

  def grad_step(params, tokens_BxLp1):
    grads, stats = _loss_and_grads(apply, loss_fn, params, tokens_BxLp1)
    grads, grad_scale, stats['grad_norm'] = _clip(grads, clip_norm, scale_in_update)
    return grads, grad_scale, stats

  out_shardings = None if grad_shardings is None else (grad_shardings, None, None)
  return jax.jit(grad_step, out_shardings=out_shardings)


def make_update_step(
    tx: optax.GradientTransformation,
    *,
    param_shardings: Any = None,
    state_shardings: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., tuple[Params, OptState]]:
  """The second program of the split step: jitted `(params, opt_state, grads,
  grad_scale=None, plan=None) -> (params, opt_state)`, donating params and optimizer
  state, `plan` static (one compilation per plan), output shardings pinned and
  `compiler_options` told as in `make_train_step`. Its wall time is the update phase
  the cost model predicts.
  """

  def update_step(params, opt_state, grads, grad_scale, plan):
    return _update(tx, params, opt_state, grads, grad_scale, plan)

  jitted = jax.jit(
      told_options(update_step, compiler_options),
      static_argnames=('plan',),
      donate_argnums=(0, 1),
      out_shardings=_pinned(param_shardings, state_shardings),
      compiler_options=None if compiler_options is None else dict(compiler_options),
  )

  @functools.wraps(update_step)
  def call(params, opt_state, grads, grad_scale=None, plan=None):
    return jitted(params, opt_state, grads, grad_scale, plan=plan)

  call.jitted = jitted  # For compile-count checks (`call.jitted._cache_size()`).
  return call


def make_eval_step(apply: Callable, loss_fn: Callable) -> Callable[[Params, jax.Array], jax.Array]:
  """Jitted mean loss of one batch, for the validation split."""
  return jax.jit(lambda params, tokens: loss_fn(apply, params, tokens)[0])


def state_shardings(opt_state: Any, mesh: jax.sharding.Mesh) -> Any:
  """The sharding (memory kind included) of every optimizer-state leaf, with leaves
  that init left off the mesh (optax's scalar step count) replicated over it."""

  def sharding(x):
    s = x.sharding
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh:
      return s
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(), memory_kind=s.memory_kind
    )

  return jax.tree.map(sharding, opt_state)
