"""Which construction the accelerator program's step builds for a state: linked chunks,
the host and device halves on two streams, or neither (`dos_jax.step.transform` builds
it; the runner's memory check asks `stream_regions`)."""

from __future__ import annotations

from dos_jax.geometry.partition import Tier
from dos_jax.geometry.state import OffloadedState
from dos_jax.offload import Offload
from dos_jax.offload import UpdateImpl
from dos_jax.step import device_stream


def constructions(offload: Offload, part, layout, mesh, native: bool) -> tuple[int, bool]:
  """`(chunks, on_two_streams)`: the linked chunks the step runs its host and streamed
  tiers in (0: none, `dos_jax.step.chunked`), and whether it runs the host and device
  halves concurrently by construction otherwise (`dos_jax.step.lanes`; a sharded state
  only packed shard-major, each device running the construction on its own columns)."""
  split = part.split
  chunks = offload.chunks if native and offload.host_impl is UpdateImpl.KERNEL else 0
  if not (split and chunks and part.per_subgroup and mesh is None
          and part.ids(Tier.HOST) and part.ids(Tier.STREAMED)):
    chunks = 0
  on_two_streams = (split and not chunks and offload.device_stream
                    and device_stream.available() and part.per_subgroup
                    and (mesh is None or layout.shards > 1)
                    and bool(part.ids(Tier.HOST))
                    and bool(part.ids(Tier.STREAMED) or part.ids(Tier.RESIDENT)))
  return chunks, bool(on_two_streams)


def step_mesh(sharded):
  """The mesh the step splits the state over: None for an unsharded state, or one on a
  one-device mesh, which splits nothing (the step is built as unsharded, its outputs
  still pinned to the mesh)."""
  return None if sharded is None or sharded.mesh.size == 1 else sharded.mesh


def stream_regions(state: OffloadedState, offload: Offload) -> tuple[bool, int]:
  """`(regions, chunks)` for the accelerator program's step of `state` (assuming the
  native host kernel): whether its streamed rows run in stream regions, which XLA keeps
  live until they are done, and in how many linked chunks (0: one). What
  `planner.costmodel.streamed_elements_held` needs to count the stream's memory.

  >>> import jax.numpy as jnp, dos_jax
  >>> off = dos_jax.Offload(policy=dos_jax.Stride(2), subgroup_size=4, chunks=2,
  ...                       storage=dos_jax.Storage.PER_SUBGROUP, platform='gpu')
  >>> state = dos_jax.abstract_state(dos_jax.adamw(1e-3, offload=off), {'w': jnp.zeros(16)})
  >>> dos_jax.stream_regions(state, off)[1]
  2
  """
  chunks, on_two_streams = constructions(offload, state.partition, state.layout,
                                          step_mesh(state.sharded), native=True)
  in_regions = on_two_streams or bool(chunks and offload.device_stream
                                      and device_stream.available())
  return in_regions and bool(state.partition.ids(Tier.STREAMED)), chunks
