"""Which mesh an offloaded state is sharded over, and meshes with Explicit axes.

The state is split over the mesh's data axis (ZeRO-1 style). The mesh comes from
`Offload.mesh`, else from the params' `NamedSharding`: concrete arrays and
`ShapeDtypeStruct`s carry it, and under jit (`jax.jit(tx.init)`) a tracer's type still
names it as an `AbstractMesh`, which `NamedSharding` accepts inside jit.

With Explicit axes (`jax.make_mesh`'s default) shardings are part of the types, and the
packing, which concatenates leaves sharded unlike each other, is refused; the
transform runs its body inside `jax.sharding.auto_axes`, with `state_specs` and the
params' specs as the outputs' shardings.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax.offload import Offload
from dos_jax.geometry.state import OffloadedState

PyTree = Any


def find_mesh(params: PyTree, offload: Offload):
  """`offload.mesh`, else the first params mesh that has `offload.data_axis`, or None."""
  if offload.mesh is not None:
    return offload.mesh
  for leaf in jax.tree.leaves(params):
    sharding = leaf_sharding(leaf)
    if sharding is None and isinstance(leaf, jax.core.Tracer):
      sharding = getattr(jax.typeof(leaf), 'sharding', None)
    if isinstance(sharding, NamedSharding) and offload.data_axis in sharding.mesh.shape:
      return sharding.mesh
  return None


def leaf_sharding(leaf):
  """A concrete array's or ShapeDtypeStruct's sharding; None for a tracer."""
  try:
    return leaf.sharding  # arrays and ShapeDtypeStructs
  except Exception:  # pylint: disable=broad-except  # tracers have no concrete sharding
    return None


def explicit_mesh(leaves):
  """The mesh of the first leaf whose type is sharded over Explicit axes, or None."""
  for leaf in leaves:
    mesh = getattr(getattr(jax.typeof(leaf), 'sharding', None), 'mesh', None)
    if mesh is not None and is_explicit(mesh):
      return mesh
  return None


def state_specs(state: OffloadedState, mesh, data_axis: str) -> OffloadedState:
  """PartitionSpecs of a state's arrays: rows split over `data_axis`, scalars whole."""
  rows = P(None, None, data_axis) if data_axis in mesh.shape else P()
  return OffloadedState(
      host=tuple(rows for _ in state.host), streamed=tuple(rows for _ in state.streamed),
      resident=tuple(rows for _ in state.resident), scalars=tuple(P() for _ in state.scalars),
      layout=state.layout, slots=state.slots, partition=state.partition,
      sharded=state.sharded, disk_gen=None if state.disk_gen is None else P())


def is_explicit(mesh) -> bool:
  """Whether `mesh` (concrete or abstract) has an Explicit axis."""
  explicit = getattr(jax.sharding.AxisType, 'Explicit', None)
  return any(t == explicit for t in getattr(mesh, 'axis_types', ()))


def as_traced(mesh):
  """`mesh` as the current trace sees its devices, for a `shard_map` over it.

  Where the trace runs under an abstract mesh that names a device kind
  (`jax.sharding.get_abstract_mesh().abstract_device`: a program lowered for a GPU
  target that is not on this machine), the same axes with that device, so that a
  kernel inside the `shard_map` lowers for it; else `mesh` unchanged.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None)
  if device is None:
    return mesh
  return getattr(mesh, 'abstract_mesh', mesh).update(abstract_device=device)
