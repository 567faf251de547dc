"""Drop-in replacements for `optax.chain` and `optax.adamw` with offloaded state."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax.numpy as jnp
import optax

from dos_jax import clipping
from dos_jax import pinned_pool
from dos_jax import validate as validate_lib
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.step.adamw_hyperparams import decay_where_row
from dos_jax.implementation import Implementation
from dos_jax.offload import Offload
from dos_jax.step.transform import offloaded

PyTree = Any


def _elementwise_updates() -> dict[Any, str]:
  """The update functions' code of optax's transforms that treat every element
  independently, by the factory that builds them: one code object per factory,
  whatever its arguments. Only these can run on a flat subgroup row."""
  built = {
      'add_decayed_weights': optax.add_decayed_weights(), 'clip': optax.clip(1.0),
      'ema': optax.ema(0.9), 'identity': optax.identity(),
      'keep_params_nonnegative': optax.keep_params_nonnegative(),
      'scale': optax.scale(1.0), 'scale_by_adam': optax.scale_by_adam(),
      'scale_by_adamax': optax.scale_by_adamax(), 'scale_by_amsgrad': optax.scale_by_amsgrad(),
      'scale_by_belief': optax.scale_by_belief(), 'scale_by_lion': optax.scale_by_lion(),
      'scale_by_rms': optax.scale_by_rms(),
      'scale_by_schedule': optax.scale_by_schedule(optax.constant_schedule(1.0)),
      'scale_by_sign': optax.scale_by_sign(), 'scale_by_stddev': optax.scale_by_stddev(),
      'scale_by_yogi': optax.scale_by_yogi(), 'trace': optax.trace(0.9),
      'decay_where_row': decay_where_row(0.0),
  }
  return {transform.update.__code__: name for name, transform in built.items()}


# `optax.scale_by_learning_rate` builds `scale` or `scale_by_schedule`: both are here.
ELEMENTWISE = _elementwise_updates()


def _elementwise(transform: optax.GradientTransformation) -> bool:
  return getattr(transform.update, '__code__', None) in ELEMENTWISE


def _display_name(transform: optax.GradientTransformation) -> str:
  """The factory's name as Python shows it, for an error message only."""
  return getattr(transform.update, '__qualname__', repr(transform.update)).split('.<locals>')[0]


def _is_stateless(transform: optax.GradientTransformation) -> bool:
  return transform.init is optax.init_empty_state


def chain(
    *transforms: optax.GradientTransformation, offload: Offload | None = None,
    implementation: Implementation | None = None,
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
    implementation: the program and update code, for tests and benchmarks (see
      `dos_jax.Implementation`); `None` means `Implementation()`. Not used when the
      last member is already an offloaded transform.

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
  validate_lib.check_implementation(implementation, 'dos_jax.chain')
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
      if not _elementwise(transform):
        name = _display_name(transform)
        raise TypeError(
            f'dos_jax.chain: transform #{position} ({name}) is not element-wise, so it cannot'
            ' run on flat subgroups. Stateless global transforms (clip_by_global_norm) must'
            ' come first; use dos_jax.adamw(mask=...) instead of masked transforms and pass'
            ' the members of a nested optax.chain individually.'
        )

  if body is None:
    body = offloaded(optax.chain(*rest), offload, implementation=implementation,
                     validate=validate)
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
    implementation: Implementation | None = None,
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
    implementation: for tests, benchmarks and experts (users leave it out): the
      program `init` builds the state for and the code that runs the updates
      (`dos_jax.Implementation`); `None` means `Implementation()`, the backend's
      program with the kernels where they are available.
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
  validate_lib.check_implementation(implementation, 'dos_jax.adamw')
  mu_dtype = _checked_mu_dtype(mu_dtype)
  hyperparams = AdamWHyperparams(
      learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
      weight_decay=weight_decay, nesterov=nesterov, mu_dtype=mu_dtype)
  checked = Offload() if offload is None else offload
  mu_bytes = 4 if mu_dtype is None else mu_dtype.itemsize
  # On a GPU, before any state exists: XLA's pinned-host pool must hold the host tiers.
  validate = functools.partial(pinned_pool.check_init, offload=checked, mask=mask,
                               mu_bytes=mu_bytes, implementation=implementation)
  return offloaded(hyperparams, offload, implementation=implementation, mask=mask,
                   validate=validate, shard_dims=shard_dims)


def _checked_mu_dtype(mu_dtype: Any) -> Any:
  """`mu_dtype` as a dtype (None stays None); a non-floating one is refused."""
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  if mu_dtype is not None and not jnp.issubdtype(mu_dtype, jnp.floating):
    raise TypeError(f'dos_jax.adamw: mu_dtype must be a real floating dtype, got {mu_dtype}')
  return mu_dtype
