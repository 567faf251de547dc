"""Whether the accelerator program's step runs its host and device halves on two
streams (`dos_jax.step.transform` builds it; the runner's memory check asks
`stream_regions`)."""

from __future__ import annotations

from dos_jax.geometry.partition import Tier
from dos_jax.geometry.state import OffloadedState
from dos_jax.step import device_stream


def on_two_streams(part, layout, mesh) -> bool:
  """Whether the step runs the host and device halves concurrently by construction
  (`dos_jax.step.lanes`): an accelerator-program state with host subgroups (in memory
  or on disk) and device ones, unsharded or packed shard-major (each device then runs
  the construction on its own columns; `device_stream.available`)."""
  return bool(part.split and device_stream.available()
              and (mesh is None or layout.shards > 1)
              and (part.ids(Tier.HOST) or part.disk)
              and (part.ids(Tier.STREAMED) or part.ids(Tier.RESIDENT)))


def step_mesh(sharded):
  """The mesh the step splits the state over: None for an unsharded state, or one on a
  one-device mesh, which splits nothing (the step is built as unsharded, its outputs
  still pinned to the mesh)."""
  return None if sharded is None or sharded.mesh.size == 1 else sharded.mesh


def stream_regions(state: OffloadedState) -> bool:
  """Whether the accelerator program's step of `state` holds its streamed rows in
  stream regions, which XLA keeps live until they are done: what
  `planner.costmodel.streamed_elements_held` needs to count the stream's memory.

  >>> import jax.numpy as jnp, dos_jax
  >>> off = dos_jax.Offload(policy=dos_jax.Stride(2), subgroup_size=4, platform='gpu')
  >>> state = dos_jax.abstract_state(dos_jax.adamw(1e-3, offload=off), {'w': jnp.zeros(16)})
  >>> dos_jax.stream_regions(state) == dos_jax.step.device_stream.available()
  True
  """
  regions = on_two_streams(state.partition, state.layout, step_mesh(state.sharded))
  return regions and bool(state.partition.ids(Tier.STREAMED))
