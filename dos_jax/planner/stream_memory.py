"""Streamed state in device memory during the update: how many rows the stream holds
at once (`streamed_elements_held`), re-exported by `costmodel`."""

from __future__ import annotations

from dos_jax.policies import Plan
from dos_jax.step import device_stream


def regions_by_default(plan: Plan) -> bool:
  """Whether an unsharded state's step runs the streamed rows of `plan` in stream
  regions: on a jax that builds them, beside host subgroups (the state is stored per
  subgroup)."""
  return device_stream.available() and bool(plan.host)


def streamed_elements_held(plan: Plan, dev_sizes: list[int], *,
                           regions: bool | None = None) -> int:
  """Elements of streamed state in device memory at once during the update: the
  stream's `buffers` rows, or, where the step runs the device tiers in stream regions
  (`device_stream.available()`), every streamed row. XLA keeps each value of an
  asynchronous computation live until its done (`HloLiveRange`), so a lane's region
  holds all of its rows; chaining one region per row would need a data edge between
  grouped calls, which XLA 0.11 rejects ("annotation groups with gaps"). `regions`:
  whether the step runs the rows in stream regions (`dos_jax.stream_regions` says for
  a built state); None: where this jax builds regions and the plan has host subgroups
  (an unsharded state)."""
  if not dev_sizes:
    return 0
  if regions is None:
    regions = regions_by_default(plan)
  if regions:
    return int(sum(dev_sizes))
  return plan.buffers * max(dev_sizes)
