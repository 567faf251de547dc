"""Streamed state in device memory during the update: how many rows the stream holds
at once (`streamed_elements_held`), re-exported by `costmodel`."""

from __future__ import annotations

from dos_jax import lowering as lowering_lib
from dos_jax.policies import Plan

MAX_LANES = 2  # `dos_jax.step.lanes.MAX_LANES`: one row in flight per lane


def regions_by_default(plan: Plan) -> bool:
  """Whether an unsharded state's step runs the streamed rows of `plan` in stream
  regions: beside host subgroups (the state is stored per subgroup)."""
  return bool(plan.host)


def streamed_elements_held(plan: Plan, dev_sizes: list[int], *,
                           regions: bool | None = None) -> int:
  """Elements of streamed state in device memory at once during the update. XLA keeps
  each value of an asynchronous computation live until its done (`HloLiveRange`): where
  the step runs the device tiers in stream regions holding a lane's rows together
  (`dos_jax.lowering.Lowering.IN_REGION`, jax 0.10-0.11) that is every streamed row; where
  each region holds one row (`STAGED`, jax 0.12), one row per lane; without regions,
  the stream's `buffers` rows. `regions`: whether the step runs the rows in stream
  regions (`dos_jax.stream_regions` says for a built state); None: where the plan has
  host subgroups (an unsharded state)."""
  if not dev_sizes:
    return 0
  if regions is None:
    regions = regions_by_default(plan)
  if regions and lowering_lib.regions_hold_every_row():
    return int(sum(dev_sizes))
  if regions:
    return min(plan.buffers, MAX_LANES, len(dev_sizes)) * max(dev_sizes)
  return plan.buffers * max(dev_sizes)
