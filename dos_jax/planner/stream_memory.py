"""Streamed state in device memory during the update: how many rows the stream holds
at once (`streamed_elements_held`), re-exported by `costmodel`."""

from __future__ import annotations

import numpy as np

from dos_jax.policies import Plan
from dos_jax.step import device_stream


def chunk_count(plan: Plan, chunks: int) -> int:
  """How many linked chunks a `chunks`-chunk step would run `plan` in (a model only:
  the step no longer builds linked chunks): at most `chunks`, each with a host and a
  streamed subgroup at least."""
  return max(1, min(chunks, len(plan.host), len(plan.streamed)))


def regions_by_default(plan: Plan, *, stacked: bool) -> bool:
  """Whether an unsharded state's step runs the streamed rows of `plan` in stream
  regions: stored per subgroup, on a jax that builds them, beside host subgroups."""
  return not stacked and device_stream.available() and bool(plan.host)


def streamed_elements_held(plan: Plan, dev_sizes: list[int], *, stacked: bool,
                           chunks: int = 0, regions: bool | None = None) -> int:
  """Elements of streamed state in device memory at once during the update: the
  stream's `buffers` rows, or, stored per subgroup where the step runs the device
  tiers in stream regions (`device_stream.available()`), every streamed row. XLA keeps
  each value of an asynchronous computation live until its done (`HloLiveRange`), so a
  lane's region holds all of its rows; chaining one region per row would need a data
  edge between grouped calls, which XLA 0.11 rejects ("annotation groups with gaps";
  RESULTS.md, 2026-11-26, ninth session). In `chunks` linked chunks (a model only:
  the step no longer builds them) chunk k+1's regions start after
  chunk k's are done, so the stream holds the largest chunk's rows (`dev_sizes` in
  stream order). `regions`: whether the step runs the rows in stream regions
  (`dos_jax.stream_regions` says for a built state); None: where they
  are stored per subgroup, this jax builds regions and the plan has host subgroups (an
  unsharded state)."""
  if not dev_sizes:
    return 0
  if regions is None:
    regions = regions_by_default(plan, stacked=stacked)
  if regions:
    parts = np.array_split(np.asarray(dev_sizes, np.int64), chunk_count(plan, chunks))
    return int(max(part.sum() for part in parts))
  return plan.buffers * max(dev_sizes)
