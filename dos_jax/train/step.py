"""The train step, in two jitted phases: gradients, then the optimizer update.

Phase 1 (`make_grad_step`): forward, backward, the global gradient norm (computed once,
used for clipping and reported), clipping. Phase 2 (`make_update_step`): the dos_jax
update and `optax.apply_updates`, with params and optimizer state donated so the update
happens in place. Two programs rather than one so the update phase can be timed on its
own (the cost model's `Auto` policy watches that time), with the placement `Plan` a
static argument: each plan compiles once and repeated steps never recompile.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import dos_jax
from dos_jax.train.config import OffloadConfig, OptimConfig

Params = Any
OptState = Any


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
) -> optax.GradientTransformation:
  """AdamW from the config: dos_jax's offloaded one, or plain `optax.adamw` when
  `offload` is None (the reference the tests and the benchmark compare against).

  Clipping is not part of the optimizer: `make_grad_step` clips, so that the global
  norm is computed once and reported.
  """
  kwargs = dict(
      learning_rate=make_schedule(optim, total_steps),
      b1=optim.b1,
      b2=optim.b2,
      eps=optim.eps,
      mu_dtype=None if optim.mu_dtype is None else jnp.dtype(optim.mu_dtype),
      weight_decay=optim.weight_decay,
      mask=decay_mask,
  )
  if offload is None:
    return optax.adamw(**kwargs)
  return dos_jax.adamw(**kwargs, offload=make_offload(offload))


def make_offload(cfg: OffloadConfig) -> Any:
  """The `dos_jax.Offload` value for the configured policy and subgroup size."""
  if cfg.subgroup_size is None:
    return dos_jax.Offload(policy=cfg.placement)
  return dos_jax.Offload(subgroup_size=cfg.subgroup_size, policy=cfg.placement)


def clip_by_global_norm(grads: Params, max_norm: float | None) -> tuple[Params, jax.Array]:
  """Scales `grads` so their global L2 norm is at most `max_norm` (as
  `optax.clip_by_global_norm`); returns them and the norm before clipping."""
  norm = optax.tree.norm(grads)
  if max_norm is None:
    return grads, norm
  factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
  return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads), norm


def make_grad_step(
    apply: Callable,
    loss_fn: Callable,
    *,
    clip_norm: float | None,
    grad_shardings: Any = None,
) -> Callable[[Params, jax.Array], tuple[Params, dict[str, jax.Array]]]:
  """Jitted `(params, tokens_BxLp1) -> (clipped grads, {'loss', 'grad_norm', ...})`.

  `grad_shardings` (the params' shardings) pins the gradients' layout so that the
  update step sees the same input shardings every step.
  """

  def grad_step(params, tokens_BxLp1):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: loss_fn(apply, p, tokens_BxLp1), has_aux=True
    )(params)
    grads, norm = clip_by_global_norm(grads, clip_norm)
    stats = {k: v for k, v in dict(metrics).items() if jnp.ndim(v) == 0}
    stats.update(loss=loss, grad_norm=norm)
    return grads, stats

  out_shardings = None if grad_shardings is None else (grad_shardings, None)
  return jax.jit(grad_step, out_shardings=out_shardings)


def make_update_step(
    tx: optax.GradientTransformation,
    *,
    param_shardings: Any = None,
    state_shardings: Any = None,
) -> Callable[..., tuple[Params, OptState]]:
  """Jitted `(params, opt_state, grads, plan=None) -> (params, opt_state)`, donating
  params and optimizer state. `plan` (a hashable `dos_jax.Plan`) is static: one
  compilation per plan. Output shardings are pinned to the inputs' (memory kinds
  included), so step t's outputs are valid inputs of step t+1 without a recompile.
  """

  def update_step(params, opt_state, grads, plan):
    extra = {} if plan is None else {'plan': plan}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state

  out_shardings = None
  if param_shardings is not None and state_shardings is not None:
    out_shardings = (param_shardings, state_shardings)
  jitted = jax.jit(
      update_step,
      static_argnames=('plan',),
      donate_argnums=(0, 1),
      out_shardings=out_shardings,
  )

  @functools.wraps(update_step)
  def call(params, opt_state, grads, plan=None):
    return jitted(params, opt_state, grads, plan=plan)

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
