"""A new offloaded state, built where it lives: `init_state` (the transform's `init`).

The host tiers are packed from the params copied to host memory, inside host regions on
the two-memory program, so the device never holds 12 bytes per parameter, not even
during init. Where the state's arrays go (`Placement`) is shared with the step, which
pins its outputs there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import meshes
from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry import slots as slots_lib
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.state import OffloadedState
from dos_jax.geometry.state import ShardedOver
from dos_jax.implementation import Implementation
from dos_jax.implementation import Program
from dos_jax.offload import Offload
from dos_jax.step import disk_tier
from dos_jax import memory_spaces


class Placement(NamedTuple):
  """Where state leaves go: per-element rows of each tier and the scalars."""

  rows: dict[Tier, Any]
  scalars: Any


def placement(mesh, data_axis: str) -> Placement:
  """The placement of a state on `mesh` (None: one device), split over `data_axis`."""
  if mesh is None:
    return Placement(
        rows={t: memory_spaces.DEVICE if t is Tier.RESIDENT else memory_spaces.HOST for t in TIERS},
        scalars=memory_spaces.DEVICE)
  return Placement(
      rows={t: NamedSharding(mesh, P(None, None, data_axis), memory_kind=t.memory_kind)
            for t in TIERS},
      scalars=NamedSharding(mesh, P(), memory_kind='device'),
  )


def place(tiers: dict[Tier, tuple], scalars, where: Placement, constrain: bool = False):
  """`(tiers, scalars)` moved to `where`; `constrain` also pins their sharding."""
  def put(x, target):
    # With Explicit mesh axes the sharding is part of the type: device_put reshards.
    if constrain and isinstance(target, NamedSharding) and not meshes.is_explicit(target.mesh):
      # device_put moves the memory; only a constraint makes sharding propagation keep
      # the spec (a device_put to an abstract mesh or of a constant may lose it).
      return jax.lax.with_sharding_constraint(jax.device_put(x, target), target)
    return jax.device_put(x, target)

  tiers = {t: tuple(put(x, where.rows[t]) for x in arrays) for t, arrays in tiers.items()}
  return tiers, tuple(put(x, where.scalars) for x in scalars)


def first_partition(policy, spec, two_memories: bool,
                    disk: partition_lib.DiskSpill | None = None) -> partition_lib.Partition:
  """The partition a new state starts in: the policy's plan, and the early host calls
  its cost model chooses for that plan (`early_calls(spec, plan)`; None or a policy
  without one: the fixed rule, `partition.early_host_calls`); `disk` spills host
  subgroups to the disk tier."""
  plan = policy.plan(spec)
  choose = getattr(policy, 'early_calls', None)
  early = choose(spec, plan) if two_memories and choose is not None else None
  return partition_lib.for_plan(plan, two_memories, early=early, disk=disk)


@dataclasses.dataclass(frozen=True)
class _Builder:
  """What builds one state's arrays: its geometry and the inner transform's row state."""

  inner: optax.GradientTransformation
  layout: layout_lib.Layout
  part: partition_lib.Partition
  slots: slots_lib.Slots
  template: Any
  mesh: Any
  where: Placement

  def row_state(self, master):
    # Element-wise transforms initialize every element alike (zeros, a constant), so
    # one row's state broadcast over the rows is the whole state, built where the
    # master is (optax's zeros_like would create it in device memory).
    return self.inner.init(master[0])

  def block_state(self, leaves, ids, space):
    """One block's stacked arrays (subgroups `ids`) and the scalars, built in `space`
    from its pieces."""
    layout = self.layout
    runs = partition_lib.pieces_of(layout, ids)
    master = partition_lib.assemble(
        partition_lib.slice_pieces(layout_lib.shard_views(leaves, layout), runs,
                                   layout.shards),
        runs, len(ids), layout.subgroup_size, jnp.dtype(layout.state_dtype), layout.shards)
    return self.split_rows(master, space)

  def split_rows(self, master, space=None):
    """`(stacked arrays, scalars)` of the `(R, S)` rows `master`: the inner transform's
    state of one row broadcast over them (its arrays put in `space` first, if given)."""
    put = (lambda x: x) if space is None else (lambda x: jax.device_put(x, space))
    state = jax.tree.map(
        lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(put(x), master.shape),
        self.row_state(master))
    return slots_lib.split((master if self.layout.needs_master else None, state),
                           self.slots, axis=1)

  def empty_tier(self):
    shapes = jax.eval_shape(lambda t: slots_lib.split(t, self.slots, axis=1)[0],
                            self.template)
    return tuple(jnp.zeros((0,) + x.shape[1:], x.dtype) for x in shapes)

  def build(self, params):
    """Every tier's arrays and the scalars, placed."""
    leaves = self.layout.treedef.flatten_up_to(params)
    part = self.part
    tiers, scalars, host_leaves = {}, None, None
    for tier in TIERS:
      if not part.ids(tier):
        tiers[tier] = () if part.two_memories else self.empty_tier()
        continue
      arrays = []
      for ids in part.blocks(tier):
        if tier is Tier.RESIDENT:
          block, scalars = self.block_state(leaves, ids, memory_spaces.DEVICE)
        else:
          if host_leaves is None:
            # 0-d leaves would drop their memory space (JAX exempts scalars); packing
            # ravels every leaf anyway.
            host_leaves = memory_spaces.to_host([jnp.atleast_1d(x) for x in leaves])
          fn = functools.partial(self.block_state, ids=ids, space=memory_spaces.HOST)
          fn = memory_spaces.host_region(fn) if part.two_memories else fn
          block, scalars = fn(host_leaves)
        arrays.extend(block)
      tiers[tier] = tuple(arrays)
    if scalars is None:  # every subgroup on disk: the scalars of one zero row
      _, scalars = self.split_rows(
          jnp.zeros((1, self.layout.subgroup_size), jnp.dtype(self.layout.state_dtype)))
    if self.mesh is not None:
      # Keeps the params an input of the jitted init even where no state value reads
      # them (fp32 params keep no master): that jit takes its devices from them.
      probe = [jnp.ravel(x)[0] for x in leaves if x.size][:1]
      scalars = tuple(jnp.where(jnp.isnan(probe[0]), x, x) for x in scalars) if probe \
          else scalars
    return place(tiers, scalars, self.where, constrain=True)

  def run(self, params, data_axis: str):
    explicit = meshes.explicit_mesh(jax.tree.leaves(params))
    if explicit is None:
      return self.build(params)
    rows = P(None, None, data_axis) if data_axis in explicit.shape else P()
    specs = ({t: (rows,) * (len(self.slots.groups) * len(self.part.blocks(t))) for t in TIERS},
             (P(),) * sum(1 for g, _ in self.slots.places if g < 0))
    with jax.sharding.use_abstract_mesh(explicit):  # see `transform.update_fn`
      return jax.sharding.auto_axes(self.build, out_sharding=specs)(params)


def init_state(inner: optax.GradientTransformation, offload: Offload, params, *,
               implementation: Implementation | None = None, mask: Any = None,
               shard_dims: Any = None, adamw: Any = None) -> OffloadedState:
  """The packed state of `inner` for `params` (see `transform.offloaded`), for the
  program `implementation` names (None: `Implementation()`, the backend's)."""
  implementation = Implementation() if implementation is None else implementation
  mesh = meshes.find_mesh(params, offload)
  layout = layout_lib.make_layout(
      params, offload.subgroup_size,
      decay_flags=layout_lib.resolve_mask(mask, params),
      shard_multiple=mesh.shape[offload.data_axis] if mesh is not None else 1,
      shard_dims=layout_lib.resolve_shard_dims(shard_dims, params),
  )
  sharded = None if mesh is None else ShardedOver(mesh, tuple(
      meshes.leaf_sharding(leaf) for leaf in layout.treedef.flatten_up_to(params)))
  state_dtype = jnp.dtype(layout.state_dtype)

  def full_state(params):
    master = layout_lib.pack(params, layout, state_dtype)
    state = jax.tree.map(
        lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(x, master.shape),
        inner.init(master[0]))
    return master if layout.needs_master else None, state

  # Shapes only: no sharding, which Explicit mesh axes would make part of the types.
  template = jax.eval_shape(full_state, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params))
  slots = slots_lib.build(template, row_ndim=2)
  part = first_partition(offload.policy, layout.spec(),
                         implementation.target() is Program.TWO_MEMORIES,
                         disk=disk_tier.spill_of(offload.disk, slots, layout.subgroup_size,
                                                 mesh, offload.data_axis))
  builder = _Builder(inner=inner, layout=layout, part=part, slots=slots, template=template,
                     mesh=mesh, where=placement(mesh, offload.data_axis))
  disk_gen = None
  if part.disk:
    disk_tier.check_usable(adamw, layout, slots, part.two_memories, mesh, params)
    if _SHAPES_ONLY.get():  # shapes only, or a restore fills the files
      disk_gen = jnp.zeros((), jnp.int32)
    elif traced_params(params):
      raise ValueError('Offload.disk: init writes the disk tier\'s files; call it outside '
                       'jit (eagerly)')
    else:
      disk_gen = disk_tier.write_initial(part, layout, params, builder.split_rows)
    if mesh is not None:
      disk_gen = jax.device_put(disk_gen, NamedSharding(mesh, P()))
  run: Callable = functools.partial(builder.run, data_axis=offload.data_axis)
  tiers, scalars = run(params) if traced_params(params) else jax.jit(run)(params)
  return OffloadedState(
      host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
      scalars=scalars, layout=layout, slots=slots, partition=part, sharded=sharded,
      disk_gen=disk_gen)


_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar('shapes_only', default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
  """Inside, `init_state` builds a disk tier's state without writing its files: traced
  for its shapes only (`dos_jax.abstract_state`), or to be filled by a restore
  (`dos_jax.restoring_state`)."""
  token = _SHAPES_ONLY.set(True)
  try:
    yield
  finally:
    _SHAPES_ONLY.reset(token)


def traced_params(params) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
