"""Checks of what users hand to the offloaded transforms, each failing with one line.

The transforms accept any tree of updates (or params) whose leaves match the params
given to `init` in order, shape and dtype class, as optax transforms do: the tree's
node types may differ (an `nnx.Optimizer` inits on a tree of `nnx.Param` and updates
with plain arrays). Anything else is refused with a ValueError naming the first leaf
that differs, by its path in the params given to `init`.
"""

from __future__ import annotations

import functools
import math
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.geometry import layout as layout_lib
from dos_jax.implementation import Implementation
from dos_jax.offload import Offload

PyTree = Any


class _NotParamsShaped:
  """What `init` returns for `optax.tree_utils.tree_map_params`'s placeholder: a leaf
  that stands for the whole offloaded state, so that `tree_map_params` leaves it as it
  is (or hands all of it to `transform_non_params`): the packed state holds no tree
  shaped like the params for `f` to map over."""

  def __repr__(self) -> str:
    return 'dos_jax.NOT_PARAMS_SHAPED'


NOT_PARAMS_SHAPED = _NotParamsShaped()


def is_params_placeholder(params: Any) -> bool:
  """Whether `params` is the stand-in `optax.tree_utils.tree_map_params` inits with."""
  cls = type(params)
  return cls.__name__ == '_ParamsPlaceholder' and cls.__module__.startswith('optax')


def check_params(params: Any) -> None:
  """Refuses what cannot be a parameter tree at `init`, before any work."""
  if params is None:
    raise TypeError('dos_jax: init(params) got None; pass the parameter pytree to optimize.')
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not hasattr(leaf, 'shape') or not hasattr(leaf, 'dtype'):
      where = jax.tree_util.keystr(path) or '<root>'
      raise TypeError(
          f'dos_jax: parameter {where} is a {type(leaf).__name__}, not an array;'
          ' init(params) needs a pytree of arrays (or jax.ShapeDtypeStruct).')


# The one line that makes a jitted step compile once (see `warn_if_uncommitted`).
COMMIT_PARAMS = 'params = jax.device_put(params, jax.devices()[0])'
_uncommitted_warned = False


def warn_if_uncommitted(params: Any) -> None:
  """Warns once per process when `init` gets uncommitted params.

  A jitted step whose program moves data between memory kinds returns committed arrays
  (jax commits every output then: `pxla`'s `transfer_mem_kind_in_jaxpr`), and the
  offloaded step always does. So the params coming out of the first step are
  committed while the user's params going in were not, and jit compiles the step a
  second time for them. Committing the params once, before the loop, avoids it; the
  state needs nothing (it is committed at `init`).
  """
  global _uncommitted_warned
  if _uncommitted_warned:
    return
  leaves = jax.tree.leaves(params)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return
  if not any(isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not x.committed)
             for x in leaves):
    return
  _uncommitted_warned = True
  warnings.warn(
      'dos_jax: init got uncommitted params. A jitted step that returns them will see'
      ' committed params from its second call on (JAX commits the outputs of programs'
      ' that move data between host and device memory) and compile once more. Commit'
      f' them once before the loop: {COMMIT_PARAMS}', stacklevel=3)


def check_offload(offload: Any, where: str) -> None:
  if offload is not None and not isinstance(offload, Offload):
    raise TypeError(
        f'{where}: offload must be a dos_jax.Offload(...) or None, got {offload!r}')


def check_implementation(implementation: Any, where: str) -> None:
  if implementation is not None and not isinstance(implementation, Implementation):
    raise TypeError(f'{where}: implementation must be a dos_jax.Implementation(...) or '
                    f'None, got {implementation!r}')


@functools.lru_cache(maxsize=64)
def _param_paths(layout: layout_lib.Layout) -> tuple[str, ...]:
  """The keystr of every params leaf, from the init-time structure."""
  try:
    placeholder = layout.treedef.unflatten(range(layout.treedef.num_leaves))
    return tuple(jax.tree_util.keystr(p) or '<root>'
                 for p, _ in jax.tree_util.tree_leaves_with_path(placeholder))
  except Exception:  # pylint: disable=broad-except  # node types that refuse ints
    return tuple(f'#{i}' for i in range(len(layout.shapes)))


def leaves_like(tree: PyTree, layout: layout_lib.Layout, what: str) -> list[Any]:
  """The leaves of `tree` (updates or params), checked against the params' layout."""
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  leaves = [leaf for _, leaf in with_paths]
  names = _param_paths(layout)
  if len(leaves) != len(names):
    given = [jax.tree_util.keystr(p) or '<root>' for p, _ in with_paths]
    first = next((i for i, (a, b) in enumerate(zip(given, names)) if a != b),
                 min(len(given), len(names)))
    where = (f'params leaf {names[first]} has no match' if len(given) < len(names)
             else f'{what} leaf {given[first]} matches no param')
    raise ValueError(
        f'dos_jax: {what} have {len(leaves)} leaves, the params given to init had'
        f' {len(names)}: {where}.')
  for i, leaf in enumerate(leaves):
    shape = tuple(jnp.shape(leaf))
    if shape != layout.shapes[i]:
      size = 'size' if math.prod(shape) != layout.sizes[i] else 'shape'
      raise ValueError(
          f'dos_jax: {what} leaf {names[i]} has {size} mismatch: shape {shape}, but the'
          f' param has shape {layout.shapes[i]}.')
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f'dos_jax: {what} leaf {names[i]} has dtype {dtype}; a floating dtype is needed'
          f' (the param is {layout.dtypes[i]}).')
  return leaves


def update_dtypes(layout: layout_lib.Layout, grad_leaves: list[Any]) -> list[jnp.dtype]:
  """optax's dtype for each update: the promotion of the param's and the gradient's.

  bf16 params with bf16 gradients get bf16 updates, as `optax.adamw` gives: wrappers
  that pick between the update and zeros in a `lax.cond` (`optax.apply_if_finite`,
  `optax.MultiSteps`) need that. fp32 gradients give fp32 updates.
  """
  return [jnp.promote_types(jnp.dtype(d), jnp.result_type(g))
          for d, g in zip(layout.dtypes, grad_leaves)]
