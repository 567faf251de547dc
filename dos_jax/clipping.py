"""Global-norm clipping that does not hold the gradients back.

`optax.clip_by_global_norm` scales every gradient by `min(1, max_norm / norm)` before the
next transform sees it. The norm needs every gradient, so in one jitted step each scaled
gradient depends on the last gradient the backward pass produces: no host-bound
gradient could leave the device before the backward pass ends. Here the norm and the
factor are computed on the device (a scalar), and the offloaded transform multiplies
each gradient by the factor where it updates it (`grad_scale`): on the host for host
subgroups, after the gradient has crossed, so the crossing starts as soon as the
backward pass has made that gradient.

The spelling: `dos_jax.chain(dos_jax.clip_by_global_norm(c), dos_jax.adamw(...))` (or
with element-wise transforms in place of `dos_jax.adamw`). Inside `optax.chain`, or
with `optax.clip_by_global_norm`, clipping is exact too but happens before the
transfers.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

_MAX_NORM = 'dos_jax_clip_max_norm'  # attribute on the update function: the max norm
_OFFLOADED = 'dos_jax_offloaded'  # attribute on an offloaded transform's update function


def clip_factor(grads: Any, max_norm: float | jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(factor, norm)`: optax.clip_by_global_norm's scale and the norm before clipping.

  For a training step of its own: pass `factor` as the offloaded update's `grad_scale`
  (`tx.update(grads, state, params, grad_scale=factor)`, where `is_offloaded(tx)`), and
  the gradients are scaled where they are updated, after their transfer.

  Args:
    grads: the gradient tree.
    max_norm: the largest global L2 norm the gradients keep.

  Returns:
    `(min(1, max_norm / norm), norm)`, both f32 scalars.
  """
  norm = optax.tree.norm(grads)
  return jnp.where(norm < max_norm, 1.0, max_norm / norm), norm


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm(max_norm)`, which `dos_jax.chain` applies on the paths.

  Alone, or in `optax.chain`, it is optax's transform. As a leading member of
  `dos_jax.chain` it becomes a `grad_scale` of the offloaded transform (see the module
  docstring): same math, in fp32, without holding gradients on the device.

  Args:
    max_norm: the largest global norm the gradients keep; larger ones are scaled down
      to it.

  Returns:
    A `GradientTransformationExtraArgs` with optax's state and math.

  Example:
    Alone it is optax's transform: a gradient tree of norm 4 comes out with norm 1.

    >>> import jax.numpy as jnp, optax, dos_jax
    >>> grads = {'w': jnp.full((2, 2), 2.0)}
    >>> clip = dos_jax.clip_by_global_norm(1.0)
    >>> clipped, _ = clip.update(grads, clip.init(grads))
    >>> clipped['w'].tolist()
    [[0.5, 0.5], [0.5, 0.5]]
    >>> float(optax.tree.norm(clipped))
    1.0

    As the first member of `dos_jax.chain`, the factor reaches the offloaded update
    (see `dos_jax.chain`'s example):

    >>> opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(1e-3))
  """
  base = optax.clip_by_global_norm(max_norm)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return base.update(updates, state, params)

  setattr(update_fn, _MAX_NORM, max_norm)
  return optax.GradientTransformationExtraArgs(base.init, update_fn)


def max_norm_of(transform: optax.GradientTransformation) -> float | None:
  """The max norm of a `clip_by_global_norm` made here, else None."""
  return getattr(transform.update, _MAX_NORM, None)


def mark_offloaded(transform: optax.GradientTransformationExtraArgs):
  """Tags an offloaded transform, so that `dos_jax.chain` can wrap it."""
  setattr(transform.update, _OFFLOADED, True)
  return transform


def is_offloaded(transform: optax.GradientTransformation) -> bool:
  """Whether `transform` is one of dos_jax's offloaded transforms (`dos_jax.adamw`,
  `dos_jax.offloaded`): its update takes `grad_scale` (and `plan`) keyword arguments,
  which optax's transforms do not."""
  return bool(getattr(transform.update, _OFFLOADED, False))


def clipped(prefix: Sequence[optax.GradientTransformation], max_norm: float,
            body: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """`optax.chain(*prefix, clip_by_global_norm(max_norm), body)` with the clip handed to
  `body` (an offloaded transform) as its `grad_scale`. The state is the chain's."""
  chained = optax.chain(*prefix, clip_by_global_norm(max_norm), body)

  def update_fn(updates, state, params=None, **extra_args):
    new_state = list(state)
    for i, transform in enumerate(prefix):
      updates, new_state[i] = transform.update(updates, state[i], params, **extra_args)
    factor, _ = clip_factor(updates, max_norm)
    updates, new_state[-1] = body.update(updates, state[-1], params, grad_scale=factor,
                                         **extra_args)
    return updates, tuple(new_state)

  return optax.GradientTransformationExtraArgs(chained.init, update_fn)
