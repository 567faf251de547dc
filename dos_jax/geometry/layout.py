"""Packing a parameter pytree into fixed-size subgroups of a flat fp32 vector.

The optimizer state of a whole model is kept as a few `(G, S)` arrays: G subgroups of
S elements each, the unit that a placement plan moves between host and device. Leaves
are raveled and concatenated in a fixed order, the reverse of the tree's (the order
in which a backward pass produces gradients, for most models); subgroup boundaries may
cut through leaves. Leaves that get weight decay are packed first and the decayed block is padded
to a whole number of subgroups, so whether a subgroup is decayed is one boolean per
row, never a per-element mask. Padding elements are zero, stay zero under AdamW (zero
gradient, zero moments), and are never unpacked into results.

A state split over a mesh axis of n devices holds, on each device, a `1/n` slice of
every row (`(G, S / n)`). With ZeRO-3 the params are split over that axis too, and the
rows are packed *shard-major* (`Layout.shards` = n): device d's slice of the rows is
the concatenation of its own shard of every leaf (`to_shards`), in the same order and
with the same offsets on every device. Packing the gradients and unpacking the new
params are then local to each device; packed leaf after leaf instead (`shards` = 1),
a row split along its length cuts across the leaves' shards, and every row is
gathered whole before it is unpacked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
    offsets: start of each leaf in the flat vector (padding included); shard-major,
      in one shard's vector of `G * shard_size` elements.
    subgroup_size: S, elements per subgroup.
    num_subgroups: G.
    decayed_rows: subgroups `[0, decayed_rows)` hold exactly the weight-decayed leaves.
    state_dtype: dtype of the master weights and second moments (float32, or float64
      when some parameter is float64).
    shards: n, the devices each row is split over when packed shard-major (see the
      module docstring); 1: leaf after leaf.
    shard_dims: shard-major, per leaf, the dimension split into `shards` parts; None:
      the raveled leaf is split, zero-padded to a multiple of `shards`.
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  offsets: tuple[int, ...]
  subgroup_size: int
  num_subgroups: int
  decayed_rows: int
  state_dtype: str
  shards: int = 1
  shard_dims: tuple[int | None, ...] = ()

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def shard_sizes(self) -> tuple[int, ...]:
    """Elements of each leaf in one shard (padding included): its size at `shards` 1."""
    return tuple(-(-n // self.shards) for n in self.sizes)

  @property
  def shard_size(self) -> int:
    """Elements of a subgroup in one shard: S at `shards` 1."""
    return self.subgroup_size // self.shards

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
        decayed_rows=self.decayed_rows,
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


def _per_leaf(tree: PyTree | Callable[[PyTree], PyTree], params: PyTree, what: str) -> list:
  """The per-leaf values of an optax-style option (a pytree over the params' leaves, or
  a callable of the params returning one); a mismatch is one line naming `what`."""
  if callable(tree):
    tree = tree(params)
  try:
    return jax.tree_util.tree_structure(params).flatten_up_to(tree)
  except (ValueError, TypeError) as err:
    raise ValueError(f'dos_jax: {what} does not match the parameter tree: {err}') from None


def resolve_mask(mask: PyTree | Callable[[PyTree], PyTree] | None, params: PyTree) -> tuple[bool, ...]:
  """Per-leaf weight-decay flags from an optax-style mask (pytree or callable)."""
  if mask is None:
    return (True,) * len(jax.tree_util.tree_leaves(params))
  return tuple(bool(f) for f in _per_leaf(mask, params, 'weight-decay mask'))


def resolve_shard_dims(dims: PyTree | Callable[[PyTree], PyTree] | None,
                       params: PyTree) -> tuple[int | None, ...] | None:
  """Per-leaf ZeRO-3 dimensions (see `make_layout`) from a pytree of ints and Nones, or
  a callable of the params returning one; None stays None (no shard-major packing)."""
  if dims is None:
    return None
  return tuple(None if d is None else int(d) for d in _per_leaf(dims, params, 'shard_dims'))


def make_layout(
    params: PyTree,
    subgroup_size: int,
    *,
    decay_flags: tuple[bool, ...] | None = None,
    shard_multiple: int = 1,
    shard_dims: tuple[int | None, ...] | None = None,
) -> Layout:
  """Plans the packing of `params` into subgroups.

  Args:
    params: the parameter pytree (arrays or ShapeDtypeStructs).
    subgroup_size: the largest subgroup wanted; a model smaller than that gets one
      subgroup per decay block, sized to fit.
    decay_flags: per-leaf weight-decay flags (all True if None).
    shard_multiple: the subgroup size is rounded up to a multiple of this (the size of
      the mesh's data axis), so each subgroup splits evenly across data shards.
    shard_dims: per leaf, the dimension split over the data axis (ZeRO-3), or None for
      a leaf not split there; given (and `shard_multiple` > 1), the rows are packed
      shard-major over `shard_multiple` shards (see the module docstring). A dimension
      that does not split evenly counts as None.

  Returns:
    The `Layout`.
  """
  leaves = _check_leaves(params)
  if decay_flags is None:
    decay_flags = (True,) * len(leaves)
  shapes = tuple(tuple(int(d) for d in np.shape(leaf)) for _, leaf in leaves)
  dtypes = tuple(jnp.dtype(jnp.result_type(leaf)).name for _, leaf in leaves)
  shards = shard_multiple if shard_dims is not None and shard_multiple > 1 else 1
  dims: tuple[int | None, ...] = ()
  if shards > 1:
    dims = tuple(None if d is None or shape[d] % shards else d
                 for d, shape in zip(shard_dims, shapes))
  sizes = [-(-math.prod(s) // shards) for s in shapes]  # per shard
  decayed = sum(s for s, f in zip(sizes, decay_flags) if f)
  plain = sum(s for s, f in zip(sizes, decay_flags) if not f)
  largest_block = max(decayed, plain) * shards
  size = min(subgroup_size, largest_block)
  size = -(-size // shard_multiple) * shard_multiple
  local = size // shards
  decayed_rows = -(-decayed // local)
  plain_rows = -(-plain // local)

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
  cursor = decayed_rows * local
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
      shards=shards,
      shard_dims=dims,
  )


def to_shards(leaf: jax.Array, layout: Layout, i: int) -> jax.Array:
  """Leaf `i` as `(shards, shard_sizes[i])`: row d is device d's shard, raveled.

  Split on a dimension, a reshape and a transpose that keep that dimension's split
  (local to each device); a leaf split on no dimension is raveled, zero-padded (by
  `lax.pad` with a scalar, so it stays in host memory inside a host region) and cut.
  """
  n, shape, dim = layout.shards, layout.shapes[i], layout.shard_dims[i]
  if dim is None:
    flat = jnp.ravel(leaf)
    gap = n * layout.shard_sizes[i] - flat.shape[0]
    if gap:
      flat = jax.lax.pad(flat, jnp.zeros((), flat.dtype), [(0, gap, 0)])
    return flat.reshape(n, -1)
  split = leaf.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:])
  return jnp.moveaxis(split, dim, 0).reshape(n, -1)


def from_shards(shards: jax.Array, layout: Layout, i: int) -> jax.Array:
  """The inverse of `to_shards`: leaf `i` from its `(shards, shard_sizes[i])` form."""
  n, shape, dim = layout.shards, layout.shapes[i], layout.shard_dims[i]
  if dim is None:
    return shards.reshape(-1)[:math.prod(shape)].reshape(shape)
  split = shards.reshape((n,) + shape[:dim] + (shape[dim] // n,) + shape[dim + 1:])
  return jnp.moveaxis(split, 0, dim).reshape(shape)


def local(layout: Layout) -> Layout:
  """One shard's layout: what each device's columns of shard-major rows hold. Every
  leaf is its raveled shard (`to_shards`' row), the subgroups `shard_size` long, the
  offsets and rows as they are; `shards` 1. A layout packed leaf after leaf is its own.

  >>> import jax.numpy as jnp
  >>> lay = make_layout({'w': jnp.zeros((8, 4))}, 16, shard_multiple=2, shard_dims=(0,))
  >>> lay.shards, lay.subgroup_size, local(lay).shapes, local(lay).subgroup_size
  (2, 16, ((16,),), 8)
  """
  if layout.shards == 1:
    return layout
  return dataclasses.replace(layout, shapes=tuple((n,) for n in layout.shard_sizes),
                             subgroup_size=layout.shard_size, shards=1, shard_dims=())


def shard_views(leaves: list[Any], layout: Layout, mesh: Any = None,
                axis: str | None = None) -> list[Any]:
  """Shard-major (`layout.shards` > 1): every leaf as `to_shards` gives it; otherwise
  `leaves` as they are.

  Given the `mesh` and the data `axis`, each leaf is first pinned to its split (its
  shard dimension over `axis`, the others left to XLA; a leaf split on no dimension
  whole), and each view to `P(axis, None)`. Without the pins XLA's sharding
  propagation runs backwards from the views into the backward pass: a replicated norm
  scale's gradient, viewed split, made it reduce whole-batch activations split over the
  width, gathered for every layer.
  """
  if layout.shards == 1:
    return leaves
  views = []
  for i, leaf in enumerate(leaves):
    dim = layout.shard_dims[i]
    if mesh is not None:
      spec = P() if dim is None else P(*(axis if d == dim else P.UNCONSTRAINED
                                         for d in range(jnp.ndim(leaf))))
      leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
    view = to_shards(leaf, layout, i)
    if mesh is not None:
      view = jax.lax.with_sharding_constraint(view, NamedSharding(mesh, P(axis, None)))
    views.append(view)
  return views


def rows_from_shards(flat: jax.Array, rows: int) -> jax.Array:
  """`(shards, rows * L)` -> `(rows, shards * L)`: shard d's elements are columns
  `[d * L, (d + 1) * L)` of every row."""
  n = flat.shape[0]
  return jnp.swapaxes(flat.reshape(n, rows, -1), 0, 1).reshape(rows, -1)


def shards_from_rows(rows: jax.Array, shards: int) -> jax.Array:
  """The inverse of `rows_from_shards`."""
  count = rows.shape[0]
  return jnp.swapaxes(rows.reshape(count, shards, -1), 0, 1).reshape(shards, -1)


def pack(tree: PyTree, layout: Layout, dtype) -> jax.Array:
  """Flattens `tree` into a `(G, S)` array of `dtype`, zero-padded.

  Padding uses `lax.pad` with a scalar fill, never a zeros array, so that packing inside
  a host computation stays entirely in host memory.
  """
  leaves = shard_views(layout.treedef.flatten_up_to(tree), layout)
  total = layout.num_subgroups * layout.shard_size
  order = sorted(range(len(leaves)), key=lambda i: layout.offsets[i])
  ends = [layout.offsets[i] for i in order[1:]] + [total]
  zero = jnp.zeros((), dtype)
  pieces = []
  for i, end in zip(order, ends):
    if layout.shards == 1:
      piece = jnp.ravel(leaves[i]).astype(dtype)
    else:
      piece = leaves[i].astype(dtype)
    gap = end - layout.offsets[i] - layout.shard_sizes[i]
    pad = [(0, 0, 0)] * (piece.ndim - 1) + [(0, gap, 0)]
    pieces.append(jax.lax.pad(piece, zero, pad) if gap else piece)
  flat = jnp.concatenate(pieces, axis=-1)
  if layout.shards > 1:
    return rows_from_shards(flat, layout.num_subgroups)
  return flat.reshape(layout.num_subgroups, layout.subgroup_size)


def unpack(flat: jax.Array, layout: Layout) -> list[jax.Array]:
  """Splits a `(G, S)` array back into leaves (in `treedef` order), dropping padding."""
  if layout.shards > 1:
    local = shards_from_rows(flat, layout.shards)
    return [from_shards(local[:, off:off + size], layout, i)
            for i, (off, size) in enumerate(zip(layout.offsets, layout.shard_sizes))]
  vector = flat.reshape(-1)
  return [
      vector[off:off + size].reshape(shape)
      for off, size, shape in zip(layout.offsets, layout.sizes, layout.shapes)
  ]


def spec_for(params: PyTree, subgroup_size: int) -> SubgroupSpec:
  """The `SubgroupSpec` of `params` packed into subgroups of `subgroup_size`."""
  return make_layout(params, subgroup_size).spec()
