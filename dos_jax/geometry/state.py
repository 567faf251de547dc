"""`OffloadedState`, the state of an offloaded transform, and how tools see it.

Inside, the per-element state is a few stacked `(R, K, S)` arrays per tier and the
scalars a flat tuple (see `slots`). Tools that walk an optax state by name, such as
`optax.tree_utils.tree_get(state, 'count')`, `tree_set`, orbax and
`flax.serialization`, see the pytree instead: its children are the tiers' arrays (with
per-subgroup storage, every subgroup's arrays in subgroup order) and the scalars, in
dicts keyed by the names of their fields in the wrapped transforms' state (`{'0': {'count': ...}}` for AdamW). So `tree_get(state, 'count')` finds the step
count as it does in optax's state (and, as there, raises when a chain has two), and
`tree_set(state, count=...)` sets it. The dicts that hold a transform's scalars also
answer for its per-element fields (`FieldView`): `tree_get(state, 'mu')` returns the
first moment as a packed `(G, S)` copy in device memory, in its own dtype; those
fields are no pytree children, so `tree_set` cannot change them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.geometry import disk_files
from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax import memory_spaces
from dos_jax.geometry import slots as slots_lib
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.partition import Tier

_ARRAY_FIELDS = ('host', 'streamed', 'resident')


@dataclasses.dataclass(frozen=True)
class ShardedOver:
  """The mesh a state is split over (ZeRO-1, along the data axis) and the shardings of
  the params it was built for.

  Static metadata of the state, so the step reads it from the state and not from the
  transform that made it: a fresh transform after a restart, or the one
  `optax.inject_hyperparams` builds at every step, keeps the layout. Hashable (it is
  part of the pytree structure, which jit compares between steps).
  """

  mesh: Any  # a jax.sharding.Mesh; an AbstractMesh when init was traced
  param_shardings: tuple[Any, ...]  # per params leaf, in layout order; None where traced


@dataclasses.dataclass(frozen=True)
class OffloadedState:
  """State of an offloaded transform.

  The per-element state is stored in tiers (see `partition`): each tier holds one
  `(R, K, S)` array per dtype (see `slots`) for its R subgroups, in ascending subgroup
  order: the fp32 master (kept only for lower-precision params) and the wrapped
  transforms' moments. A tier with no subgroup holds `(0, K, S)` arrays. With
  per-subgroup storage (`Partition.two_memories`) a tier holds those arrays for each of
  its subgroups, `(1, K, S)` each, block after block, and an empty tier holds none.

  As a pytree its children are `host`, `streamed`, `resident` and the scalars keyed
  by their field names (see the module docstring); `layout`, `slots`, `partition` and
  `sharded` are static.

  Attributes:
    host: the host-updated subgroups' state, in `pinned_host` memory.
    streamed: the device-streamed subgroups' state, in `pinned_host` memory.
    resident: the state kept in device memory (`AllDevice`).
    scalars: the wrapped transforms' scalar state (step counts), shared by every
      subgroup since all subgroups take every step together; in device memory.
    layout: how parameters map onto subgroups (static metadata).
    slots: where each state leaf is stored (static metadata).
    partition: which subgroups each tier holds, and for which program
      (`Partition.two_memories`) (static metadata).
    sharded: the mesh the state is split over and the params' shardings, or None for
      a state on one device (static metadata).
    disk_gen: the disk tier's generation (an int32 scalar: which of each disk
      subgroup's two files holds the current state, `dos_jax.kernels.host_adamw_disk`),
      or None without a disk tier (`partition.disk` empty). Its files are the state;
      this scalar is all the program carries of them.
  """

  host: tuple[jax.Array, ...]
  streamed: tuple[jax.Array, ...]
  resident: tuple[jax.Array, ...]
  scalars: tuple[jax.Array, ...]
  layout: layout_lib.Layout
  slots: slots_lib.Slots
  partition: partition_lib.Partition
  sharded: ShardedOver | None = None
  disk_gen: jax.Array | None = None
  # What a pytree round trip brought at the children that hold no array (empty tiers,
  # the scalars when there are none), given back as they came: tools that treat empty
  # nodes as leaves (orbax) put their own values there and expect them back.
  empty_children: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

  def tier(self, tier: Tier) -> tuple[jax.Array, ...]:
    return getattr(self, tier.value)

  @property
  def tiers(self) -> dict[Tier, tuple[jax.Array, ...]]:
    return {tier: self.tier(tier) for tier in TIERS}

  def with_tiers(self, tiers: dict[Tier, tuple[jax.Array, ...]],
                 partition: partition_lib.Partition) -> 'OffloadedState':
    """This state with other tier arrays, laid out as `partition` says."""
    return OffloadedState(
        host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
        scalars=self.scalars, layout=self.layout, slots=self.slots, partition=partition,
        sharded=self.sharded, disk_gen=self.disk_gen)

  def by_subgroup(self) -> tuple[tuple[jax.Array, ...], ...]:
    """Per-subgroup storage: each subgroup's arrays (one per dtype), in subgroup order;
    the disk tier's subgroups, which have no arrays, are left out."""
    part = self.partition
    rows: dict[int, tuple] = {}
    for tier in TIERS:
      blocks = part.blocks(tier)
      for (g,), block in zip(blocks, partition_lib.blocks_of(self.tier(tier), len(blocks))):
        rows[g] = block
    return tuple(rows[g] for g in range(part.num_subgroups) if g in rows)

  def rows(self) -> tuple[jax.Array, ...]:
    """The whole per-element state, one `(G, K, S)` array per dtype in subgroup order.
    A copy in device memory: for inspection and checkpoints, not for the training step."""
    moved = {t: tuple(to_memory(x, Tier.RESIDENT) for x in arrays)
             for t, arrays in self.tiers.items()}
    part = self.partition
    if not part.disk:
      return partition_lib.merge_tiers(moved, part)
    # The disk tier's files read back, with the tiers in memory (one f32 group: the
    # disk tier's only form).
    rows = dict(disk_files.read_rows(part, self.slots, self.layout.subgroup_size,
                                    self.disk_gen))
    for tier in TIERS:
      blocks = part.blocks(tier)
      for ids, block in zip(blocks, partition_lib.blocks_of(moved[tier], len(blocks))):
        rows.update((g, block[0][i]) for i, g in enumerate(ids))
    return (jnp.stack([jnp.asarray(rows[g]) for g in range(part.num_subgroups)]),)

  def unstacked(self) -> tuple[jax.Array | None, Any]:
    """`(master, inner_state)` as the wrapped transforms define it, with `(G, S)`
    leaves; a copy in device memory (see `rows`)."""
    return slots_lib.join(self.rows(), self.scalars, self.slots, axis=1)

  @property
  def inner(self) -> Any:
    """The wrapped transforms' state (e.g. `inner[0].mu`), unstacked; see `unstacked`."""
    return self.unstacked()[1]

  @property
  def master(self) -> jax.Array | None:
    """The `(G, S)` fp32 master weights, or None when params are fp32; a copy."""
    return self.unstacked()[0]


def to_memory(x: jax.Array, tier: Tier) -> jax.Array:
  """`x` copied into the memory of `tier` (device for resident, else pinned host),
  keeping its sharding: by memory space under a trace, by memory kind eagerly."""
  resident = tier is Tier.RESIDENT
  if isinstance(x, jax.core.Tracer):
    return jax.device_put(x, memory_spaces.DEVICE if resident else memory_spaces.HOST)
  return memory_spaces.copy_to(x, x.sharding.with_memory_kind(tier.memory_kind))


def _key_name(key: Any) -> str:
  for attr in ('name', 'idx', 'key'):  # GetAttrKey, SequenceKey, DictKey / FlattenedIndexKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


@functools.lru_cache(maxsize=256)
def _view_structure(slots: slots_lib.Slots) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...]]:
  """(scalar index, key names of its path in the wrapped transforms' state) per scalar."""
  marks = [k if group < 0 else None for group, k in slots.places]
  template = slots.treedef.unflatten(marks)[1]
  with_paths = jax.tree_util.tree_leaves_with_path(template)
  return (tuple(k for _, k in with_paths),
          tuple(tuple(_key_name(key) for key in path) for path, _ in with_paths))


@functools.lru_cache(maxsize=256)
def _moment_structure(slots: slots_lib.Slots) -> tuple[tuple[tuple[str, ...], int, int], ...]:
  """(key names of its path, group, k) per per-element leaf of the wrapped transforms'
  state (`mu`, `nu`, ...), the fp32 master excluded."""
  marks = [None if group < 0 else _Place(group, k) for group, k in slots.places]
  template = slots.treedef.unflatten(marks)[1]
  with_paths = jax.tree_util.tree_leaves_with_path(template)
  return tuple((tuple(_key_name(key) for key in path), place.group, place.k)
               for path, place in with_paths)


@dataclasses.dataclass(frozen=True)
class _Place:
  """A per-element leaf's slot, as a pytree leaf (a plain tuple would be a node)."""

  group: int
  k: int


def moment_rows(state: 'OffloadedState', group: int, k: int) -> jax.Array:
  """One per-element leaf of the wrapped transforms' state (row `k` of stacked array
  `group`) as a `(G, S)` array in subgroup order, in its own dtype: a copy in device
  memory of that leaf only."""
  if state.partition.disk:
    return state.rows()[group][:, k]
  width = len(state.slots.groups)
  moved = {t: tuple(to_memory(x[:, k:k + 1] if j % width == group else x[:, :0], Tier.RESIDENT)
                    for j, x in enumerate(arrays))
           for t, arrays in state.tiers.items()}
  return partition_lib.merge_tiers(moved, state.partition)[group][:, 0]


class FieldView(dict):
  """A node of `scalar_view`: the scalar fields of one wrapped transform's state (as a
  dict, e.g. `{'count': c}`), which also answers for that state's per-element fields.

  `view['mu']` and `'mu' in view` see AdamW's first moment as `moment_rows` gives it
  (a `(G, S)` copy in device memory, made when asked), so that
  `optax.tree.get(state, 'mu')` finds it. Those fields are no children: the pytree's
  leaves, `items()` and `optax.tree.set` see only the scalars.
  """

  def __init__(self, scalars: dict[str, Any], moments: dict[str, Any]):
    super().__init__(scalars)
    self._moments = moments  # name -> zero-argument function making the view

  def __contains__(self, key: object) -> bool:
    return dict.__contains__(self, key) or key in self._moments

  def __getitem__(self, key: str) -> Any:
    if dict.__contains__(self, key):
      return dict.__getitem__(self, key)
    return self._moments[key]()


def _field_view_flatten_with_keys(view: FieldView):
  keys = sorted(dict.keys(view))
  return (tuple((jax.tree_util.DictKey(k), dict.__getitem__(view, k)) for k in keys),
          tuple(keys))


def _field_view_flatten(view: FieldView):
  keys = sorted(dict.keys(view))
  return tuple(dict.__getitem__(view, k) for k in keys), tuple(keys)


jax.tree_util.register_pytree_with_keys(
    FieldView, _field_view_flatten_with_keys, lambda keys, children: dict(zip(keys, children)),
    _field_view_flatten)


def scalar_view(scalars: tuple, slots: slots_lib.Slots,
                state: 'OffloadedState | None' = None) -> Any:
  """The scalars in nested dicts keyed by their path in the wrapped transforms' state,
  e.g. `{'0': {'count': c}}` for AdamW's chain; `()` when there are none. Given the
  `state`, the dicts that hold a transform's scalars are `FieldView`s, which also
  answer for that transform's per-element fields (`mu`, `nu`).

  Only scalars, no None and no empty node: tools that treat those as leaves (orbax)
  then see only leaves that survive a round trip through the state.
  """
  order, names = _view_structure(slots)
  if not order:
    return ()
  view: dict[str, Any] = {}
  for k, path in zip(order, names):
    node = view
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = scalars[k]
  if state is not None:
    view = _with_moments(view, state)
  return view


def _with_moments(view: dict[str, Any], state: 'OffloadedState') -> dict[str, Any]:
  """`view` with each dict that holds a transform's scalars made a `FieldView` that
  also answers for that transform's per-element fields."""
  moments: dict[tuple[str, ...], dict[str, Any]] = {}
  for path, group, k in _moment_structure(state.slots):
    moments.setdefault(path[:-1], {})[path[-1]] = functools.partial(moment_rows, state, group, k)

  def rebuild(node, path):
    if not isinstance(node, dict):
      return node
    children = {name: rebuild(child, path + (name,)) for name, child in node.items()}
    return FieldView(children, moments[path]) if path in moments else children

  return rebuild(view, ())


def scalars_from_view(view: Any, slots: slots_lib.Slots) -> tuple:
  """The inverse of `scalar_view`; its leaves may be anything (tracers, specs)."""
  order, names = _view_structure(slots)
  out = [None] * len(order)
  for k, path in zip(order, names):
    node = view
    for name in path:
      node = node[name]
    out[k] = node
  return tuple(out)


def _children(state: OffloadedState, moments: bool = True) -> tuple:
  """Stacked storage: the three tiers and the scalars. A tier without subgroups is
  `()`: its `(0, K, S)` arrays are no leaves (orbax refuses to save zero-size arrays)
  and are made again, from the static metadata, by `_unflatten`.

  Per-subgroup storage: every subgroup's arrays in subgroup order, then the scalars.
  The leaves keep their order whatever the plan, so `jit`'s donation (which pairs
  donated inputs with outputs of the same shape in order) gives each row its own
  buffer back, also in a step whose plan moves rows between tiers."""
  part = state.partition
  raw = state.empty_children or (None,) * 4
  view = scalar_view(state.scalars, state.slots, state if moments else None)
  if not state.scalars and raw[3] is not None:
    view = raw[3]
  disk = (state.disk_gen,) if part.disk else ()
  if part.two_memories:
    return (state.by_subgroup(), view) + disk
  tiers = tuple(state.tier(t) if part.ids(t) else (() if r is None else r)
                for t, r in zip(TIERS, raw))
  return tiers + (view,) + disk


def _child_names(part: partition_lib.Partition) -> tuple[str, ...]:
  names = ('subgroups', 'scalars') if part.two_memories else _ARRAY_FIELDS + ('scalars',)
  return names + (('disk_gen',) if part.disk else ())


@functools.lru_cache(maxsize=1024)
def empty_tier(layout: layout_lib.Layout, slots: slots_lib.Slots,
               tier: Tier) -> tuple[jax.Array, ...]:
  """The `(0, K, S)` arrays of a tier without subgroups, in the tier's memory kind on
  the first device: made once per layout, eagerly even inside a trace (they hold no
  data, so a concrete array is a fine constant there)."""
  with jax.ensure_compile_time_eval():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                 memory_kind=tier.memory_kind)
    return tuple(jax.device_put(np.zeros((0, k, layout.subgroup_size), jnp.dtype(g)), sharding)
                 for g, k in zip(slots.groups, slots.group_sizes))


def _static(state: OffloadedState) -> tuple:
  """The pytree's aux data: what the step needs besides the arrays."""
  return state.layout, state.slots, state.partition, state.sharded


def _flatten_with_keys(state: OffloadedState):
  keys = [jax.tree_util.GetAttrKey(n) for n in _child_names(state.partition)]
  return tuple(zip(keys, _children(state))), _static(state)


def _flatten(state: OffloadedState):
  return _children(state), _static(state)


def _unflatten(aux, children) -> OffloadedState:
  layout, slots, partition, sharded = aux
  disk_gen = children[-1] if partition.disk else None
  children = children[:-1] if partition.disk else children
  if partition.two_memories:
    rows, view = children
    in_memory = [g for g in range(partition.num_subgroups) if g not in partition.disk]
    rows = dict(zip(in_memory, rows))
    tiers = [tuple(x for g in partition.ids(t) for x in rows[g]) for t in TIERS]
    scalars = scalars_from_view(view, slots)
    raw = (None, None, None, None if scalars else view)
  else:
    tiers = [tuple(c) if partition.ids(t) else empty_tier(layout, slots, t)
             for t, c in zip(TIERS, children[:3])]
    scalars = scalars_from_view(children[3], slots)
    raw = tuple(None if partition.ids(t) else c for t, c in zip(TIERS, children[:3]))
    raw += (None if scalars else children[3],)
  return OffloadedState(host=tiers[0], streamed=tiers[1], resident=tiers[2],
                        scalars=scalars, layout=layout, slots=slots, partition=partition,
                        sharded=sharded, disk_gen=disk_gen, empty_children=raw)


jax.tree_util.register_pytree_with_keys(OffloadedState, _flatten_with_keys, _unflatten,
                                        _flatten)


def _register_flax_serialization() -> None:
  """`flax.serialization.to_bytes(state)` / `from_bytes(target, data)` support.

  The restored arrays are placed like the target's (host state back in pinned_host).
  """
  try:
    from flax import serialization  # pylint: disable=import-outside-toplevel
  except ImportError:  # flax is optional for the library itself
    return
  def to_state_dict(state: OffloadedState) -> dict[str, Any]:
    names = _child_names(state.partition)
    children = _children(state, moments=False)
    return {n: serialization.to_state_dict(c) for n, c in zip(names, children)}

  def from_state_dict(target: OffloadedState, state_dict: dict[str, Any]) -> OffloadedState:
    names = _child_names(target.partition)
    missing = [n for n in names if n not in state_dict]
    if missing:
      raise ValueError(f'dos_jax: serialized OffloadedState lacks {missing}')
    children = []
    for name, child in zip(names, _children(target, moments=False)):
      restored = serialization.from_state_dict(child, state_dict[name], name=name)
      restored = jax.tree.unflatten(jax.tree.structure(child), jax.tree.leaves(restored))
      children.append(jax.tree.map(_placed_like, child, restored))
    return _unflatten(_static(target), children)

  serialization.register_serialization_state(OffloadedState, to_state_dict, from_state_dict,
                                             override=True)


def _placed_like(target: Any, value: Any) -> Any:
  sharding = getattr(target, 'sharding', None)
  if isinstance(target, jax.Array) and sharding is not None:
    return jax.device_put(value, sharding)
  return value


_register_flax_serialization()
