"""Packing a parameter pytree into fixed-size subgroups of a flat fp32 vector.

The optimizer state of a whole model is kept as a few `(G, S)` arrays: G subgroups of
S elements each, the unit that a placement plan moves between host and device. Leaves
are raveled and concatenated in a fixed order, the reverse of the tree's (the order
in which a backward pass produces gradients, for most models); subgroup boundaries may
cut through leaves. Leaves that get weight decay are packed first and the decayed block is padded
to a whole number of subgroups, so whether a subgroup is decayed is one boolean per
row, never a per-element mask. Padding elements are zero, stay zero under AdamW (zero
gradient, zero moments), and are never unpacked into results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.policies import SubgroupSpec

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of how a pytree maps onto `(num_subgroups, subgroup_size)`.

  Hashable, so it can live in a state's pytree metadata and in jit cache keys.

  Attributes:
    treedef: structure of the parameter pytree.
    shapes: shape of each leaf, in `treedef` leaf order.
    dtypes: dtype name of each parameter leaf.
    offsets: start of each leaf in the flat vector (padding included).
    subgroup_size: S, elements per subgroup.
    num_subgroups: G.
    decayed_rows: subgroups `[0, decayed_rows)` hold exactly the weight-decayed leaves.
    state_dtype: dtype of the master weights and second moments (float32, or float64
      when some parameter is float64).
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  offsets: tuple[int, ...]
  subgroup_size: int
  num_subgroups: int
  decayed_rows: int
  state_dtype: str

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def num_elements(self) -> int:
    return sum(self.sizes)

  @property
  def needs_master(self) -> bool:
    """A separate master copy is kept when some parameter is below the state precision."""
    return any(d != self.state_dtype for d in self.dtypes)

  @property
  def lowp_dtype(self) -> jnp.dtype:
    """dtype of the flat parameter output: the params' own when they all agree."""
    if len(set(self.dtypes)) == 1:
      return jnp.dtype(self.dtypes[0])
    return jnp.dtype(self.state_dtype)

  def spec(self, mu_bytes: int = 4) -> SubgroupSpec:
    """The `SubgroupSpec` a placement policy plans from."""
    lowp = self.lowp_dtype.itemsize
    state = (jnp.dtype(self.state_dtype).itemsize * (1 + int(self.needs_master))) + mu_bytes
    return SubgroupSpec(
        num_subgroups=self.num_subgroups,
        subgroup_size=self.subgroup_size,
        num_elements=self.num_elements,
        state_bytes_per_element=state,
        param_bytes_per_element=lowp,
        grad_bytes_per_element=lowp,
    )


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or '<root>'


def _check_leaves(tree: PyTree) -> list[tuple[Any, Any]]:
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if not leaves:
    raise ValueError('dos_jax: the parameter tree is empty; nothing to optimize.')
  for path, leaf in leaves:
    dtype = jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
          f'dos_jax: parameter {_path_str(path)} is complex ({dtype}); complex parameters'
          ' are not supported by the offloaded optimizer.'
      )
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f'dos_jax: parameter {_path_str(path)} has dtype {dtype}; only floating-point'
          ' parameters can be optimized.'
      )
  return leaves


def resolve_mask(mask: PyTree | Callable[[PyTree], PyTree] | None, params: PyTree) -> tuple[bool, ...]:
  """Per-leaf weight-decay flags from an optax-style mask (pytree or callable)."""
  num_leaves = len(jax.tree_util.tree_leaves(params))
  if mask is None:
    return (True,) * num_leaves
  if callable(mask):
    mask = mask(params)
  try:
    flags = jax.tree_util.tree_structure(params).flatten_up_to(mask)
  except (ValueError, TypeError) as err:
    raise ValueError(
        f'dos_jax: weight-decay mask does not match the parameter tree: {err}'
    ) from None
  return tuple(bool(f) for f in flags)


def make_layout(
    params: PyTree,
    subgroup_size: int,
    *,
    decay_flags: tuple[bool, ...] | None = None,
    shard_multiple: int = 1,
) -> Layout:
  """Plans the packing of `params` into subgroups.

  Args:
    params: the parameter pytree (arrays or ShapeDtypeStructs).
    subgroup_size: the largest subgroup wanted; a model smaller than that gets one
      subgroup per decay block, sized to fit.
    decay_flags: per-leaf weight-decay flags (all True if None).
    shard_multiple: the subgroup size is rounded up to a multiple of this (the size of
      the mesh's data axis), so each subgroup splits evenly across data shards.

  Returns:
    The `Layout`.
  """
  leaves = _check_leaves(params)
  if decay_flags is None:
    decay_flags = (True,) * len(leaves)
  shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for _, leaf in leaves)
  dtypes = tuple(jnp.dtype(jnp.result_type(leaf)).name for _, leaf in leaves)
  sizes = [math.prod(s) for s in shapes]
  decayed = sum(s for s, f in zip(sizes, decay_flags) if f)
  plain = sum(s for s, f in zip(sizes, decay_flags) if not f)
  largest_block = max(decayed, plain)
  size = min(subgroup_size, largest_block)
  size = -(-size // shard_multiple) * shard_multiple
  decayed_rows = -(-decayed // size)
  plain_rows = -(-plain // size)

  offsets = [0] * len(leaves)
  cursor = 0
  # Within each block, leaves go in the reverse of the tree's order. The backward pass
  # makes gradients in the reverse of the forward order, and a model's tree order
  # mostly follows its forward pass, so the first subgroups fill with the first
  # gradients made; a plan can send those to the host while the backward pass runs.
  backward = list(reversed(range(len(leaves))))
  for i in [i for i in backward if decay_flags[i]]:
    offsets[i] = cursor
    cursor += sizes[i]
  cursor = decayed_rows * size
  for i in [i for i in backward if not decay_flags[i]]:
    offsets[i] = cursor
    cursor += sizes[i]
  state_dtype = 'float64' if 'float64' in dtypes else 'float32'
  return Layout(
      treedef=jax.tree_util.tree_structure(params),
      shapes=shapes,
      dtypes=dtypes,
      offsets=tuple(offsets),
      subgroup_size=size,
      num_subgroups=decayed_rows + plain_rows,
      decayed_rows=decayed_rows,
      state_dtype=state_dtype,
  )


def pack(tree: PyTree, layout: Layout, dtype) -> jax.Array:
  """Flattens `tree` into a `(G, S)` array of `dtype`, zero-padded.

  Padding uses `lax.pad` with a scalar fill, never a zeros array, so that packing inside
  a host computation stays entirely in host memory.
  """
  leaves = layout.treedef.flatten_up_to(tree)
  total = layout.num_subgroups * layout.subgroup_size
  order = sorted(range(len(leaves)), key=lambda i: layout.offsets[i])
  ends = [layout.offsets[i] for i in order[1:]] + [total]
  zero = jnp.zeros((), dtype)
  pieces = []
  for i, end in zip(order, ends):
    piece = jnp.ravel(leaves[i]).astype(dtype)
    gap = end - layout.offsets[i] - layout.sizes[i]
    pieces.append(jax.lax.pad(piece, zero, [(0, gap, 0)]) if gap else piece)
  return jnp.concatenate(pieces).reshape(layout.num_subgroups, layout.subgroup_size)


def unpack(flat: jax.Array, layout: Layout) -> list[jax.Array]:
  """Splits a `(G, S)` array back into leaves (in `treedef` order), dropping padding."""
  vector = flat.reshape(-1)
  return [
      vector[off:off + size].reshape(shape)
      for off, size, shape in zip(layout.offsets, layout.sizes, layout.shapes)
  ]


def spec_for(params: PyTree, subgroup_size: int) -> SubgroupSpec:
  """The `SubgroupSpec` of `params` packed into subgroups of `subgroup_size`."""
  return make_layout(params, subgroup_size).spec()
