"""Drop-in replacements for `optax.chain` and `optax.adamw` with offloaded state."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from dos_jax import clipping
from dos_jax import pinned_pool
from dos_jax import validate as validate_lib
from dos_jax.step.fused import FusedAdamW
from dos_jax.offload import Offload
from dos_jax.step.transform import offloaded

PyTree = Any

# Optax transforms whose update treats every element independently, by the name of the
# factory that built them. Only these can run on a flat subgroup row.
ELEMENTWISE = frozenset({
    'add_decayed_weights', 'clip', 'ema', 'identity', 'keep_params_nonnegative', 'scale',
    'scale_by_adam', 'scale_by_adamax', 'scale_by_amsgrad', 'scale_by_belief',
    'scale_by_learning_rate', 'scale_by_lion', 'scale_by_rms', 'scale_by_schedule',
    'scale_by_sign', 'scale_by_stddev', 'scale_by_yogi', 'trace', 'decay_where_row',
})


def _factory_name(transform: optax.GradientTransformation) -> str:
  return getattr(transform.update, '__qualname__', repr(transform.update)).split('.<locals>')[0]


def _is_stateless(transform: optax.GradientTransformation) -> bool:
  return getattr(transform.init, '__qualname__', '') == 'init_empty_state'


def decay_where_row(weight_decay: float | jax.Array) -> optax.GradientTransformationExtraArgs:
  """`optax.add_decayed_weights` for one subgroup row: decays only rows of decayed leaves.

  The layout packs masked-in leaves into whole subgroups, so the mask becomes the
  per-row flag `row_decayed` that the offloaded update passes in.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, row_decayed=True, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    decayed = jax.tree.map(
        lambda u, p: jnp.where(row_decayed, u + weight_decay * p, u), updates, params
    )
    return decayed, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def chain(
    *transforms: optax.GradientTransformation, offload: Offload | None = None
) -> optax.GradientTransformationExtraArgs:
  """`optax.chain` whose state lives in host-memory subgroups.

  Leading stateless transforms (e.g. `optax.clip_by_global_norm`) run first on the whole
  gradient tree, so global quantities such as the gradient norm are computed before the
  subgroup loop. The remaining transforms must be element-wise (`ELEMENTWISE`); any
  other is rejected at `init` with a TypeError that names it. Instead of them, the last
  member may be one offloaded transform (`dos_jax.adamw(...)`).

  When the last leading transform is `dos_jax.clip_by_global_norm(c)`, the clip factor
  is applied where each subgroup is updated, so host-bound gradients leave the device
  without waiting for the norm (see `dos_jax.clipping`).

  Args:
    *transforms: optax transforms, in order.
    offload: subgroup size and placement policy; `None` means `Offload()`. Not used
      when the last member is already an offloaded transform.

  Returns:
    A `GradientTransformationExtraArgs`; its update accepts `plan=` for one step.

  Example:
    One step clipped and updated in subgroups of 8, against the same `optax.chain`:

    >>> import jax, jax.numpy as jnp, optax, dos_jax
    >>> params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}
    >>> params = jax.device_put(params, jax.devices()[0])  # committed: compiles once
    >>> members = (optax.scale_by_adam(), optax.add_decayed_weights(0.1),
    ...            optax.scale_by_learning_rate(1e-3))
    >>> opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), *members,
    ...                     offload=dos_jax.Offload(subgroup_size=8))
    >>> ref = optax.chain(optax.clip_by_global_norm(1.0), *members)
    >>> grads = {'w': jnp.full((4, 3), 2.0), 'b': jnp.ones(3)}
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> want, _ = ref.update(grads, ref.init(params), params)
    >>> jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, rtol=1e-6, atol=0)), updates, want)
    {'b': True, 'w': True}
  """
  validate_lib.check_offload(offload, 'dos_jax.chain')
  split = 0
  while split < len(transforms) and _is_stateless(transforms[split]):
    split += 1
  prefix, rest = transforms[:split], transforms[split:]
  if not rest:  # no state at all: nothing to offload
    return optax.chain(*transforms)
  if len(rest) == 1 and clipping.is_offloaded(rest[0]):
    body = rest[0]
  else:
    body = None

  def validate(params):
    del params
    for position, transform in enumerate(rest, start=split):
      name = _factory_name(transform)
      if name not in ELEMENTWISE:
        raise TypeError(
            f'dos_jax.chain: transform #{position} ({name}) is not element-wise, so it cannot'
            ' run on flat subgroups. Stateless global transforms (clip_by_global_norm) must'
            ' come first; use dos_jax.adamw(mask=...) instead of masked transforms and pass'
            ' the members of a nested optax.chain individually.'
        )

  if body is None:
    body = offloaded(optax.chain(*rest), offload, validate=validate)
  if not prefix:
    return body
  max_norm = clipping.max_norm_of(prefix[-1])
  if max_norm is not None:
    return clipping.clipped(prefix[:-1], max_norm, body)
  return optax.chain(*prefix, body)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: float = 1e-4,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    *,
    nesterov: bool = False,
    offload: Offload | None = None,
    shard_dims: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW with its state in host memory, split into subgroups: `optax.adamw`'s math.

  Every argument means what it means in `optax.adamw`. The state is the fp32 master
  weights (kept only for lower-precision params), `mu` (in `mu_dtype`, default fp32)
  and `nu` (fp32), packed into `offload.subgroup_size`-element subgroups in
  `pinned_host` memory. Each step the placement policy decides which subgroups are
  streamed to the device and which are updated on the host.

  With bf16/fp16 params the result is optax.adamw run on the fp32 master, then cast;
  moments default to fp32; updates have optax's dtype (docs/optimizer.md, "Mixed
  precision", says when `optax.apply_updates` reproduces the cast master exactly).

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root: as in `optax.scale_by_adam`.
    mu_dtype: dtype of the first moment (bf16 halves its host memory).
    weight_decay: decoupled weight decay.
    mask: pytree of booleans or a callable returning one: which leaves are decayed.
    nesterov: Nesterov momentum, as in `optax.adamw`.
    offload: subgroup size and placement policy; `None` means `Offload()`.
    shard_dims: ZeRO-3 (params split over `offload.data_axis`, as the state is): per
      leaf, a pytree or a callable of the params, the dimension split over that axis,
      or None. Given, each device packs its own shard of every leaf into its slice of
      the rows, so the update gathers no row (see `dos_jax.offloaded`).

  Returns:
    A `GradientTransformationExtraArgs`; its update accepts `plan=` for one step.

  Raises:
    dos_jax.PinnedPoolError: at `init` on a GPU, when the host tiers do not fit XLA's
      pinned-host pool; the message names the value to set.

  Example:
    One step against `optax.adamw` (to a last bit); the state in `pinned_host` memory:

    >>> import jax, jax.numpy as jnp, optax, dos_jax
    >>> params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}
    >>> params = jax.device_put(params, jax.devices()[0])  # committed: compiles once
    >>> opt = dos_jax.adamw(1e-1, offload=dos_jax.Offload(subgroup_size=8))
    >>> state = opt.init(params)
    >>> 'pinned_host' in {x.sharding.memory_kind for x in jax.tree.leaves(state)}
    True
    >>> grads = {'w': jnp.full((4, 3), 0.5), 'b': jnp.ones(3)}
    >>> updates, state = opt.update(grads, state, params)
    >>> ref = optax.adamw(1e-1)
    >>> want, _ = ref.update(grads, ref.init(params), params)
    >>> jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, rtol=1e-6, atol=0)), updates, want)
    {'b': True, 'w': True}
  """
  validate_lib.check_offload(offload, 'dos_jax.adamw')
  mu_dtype = _checked_mu_dtype(mu_dtype)
  inner = optax.chain(
      optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                          nesterov=nesterov),
      decay_where_row(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  fused = FusedAdamW(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     weight_decay=weight_decay, nesterov=nesterov, mu_dtype=mu_dtype)
  checked = Offload() if offload is None else offload
  mu_bytes = 4 if mu_dtype is None else mu_dtype.itemsize
  # On a GPU, before any state exists: XLA's pinned-host pool must hold the host tiers.
  validate = functools.partial(pinned_pool.check_init, offload=checked, mask=mask,
                               mu_bytes=mu_bytes)
  return offloaded(inner, offload, mask=mask, validate=validate, fused=fused,
                   shard_dims=shard_dims)


def _checked_mu_dtype(mu_dtype: Any) -> Any:
  """`mu_dtype` as a dtype (None stays None); a non-floating one is refused."""
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  if mu_dtype is not None and not jnp.issubdtype(mu_dtype, jnp.floating):
    raise TypeError(f'dos_jax.adamw: mu_dtype must be a real floating dtype, got {mu_dtype}')
  return mu_dtype
