"""Plan changes: checking a plan against a state, and moving rows between the tiers.

A new plan (from `Auto`, or `plan=` naming another split) changes which tier each
subgroup's row lives in. `migrate` runs inside the jitted step that first uses the
plan: tiers whose subgroups stay put pass through untouched (under donation they keep
their buffers), changed tiers are rebuilt from runs of consecutive rows, each sliced
where it lives and copied straight into its new memory. An XLA array cannot grow or
shrink in place, so a changed tier's new array exists beside the old one until the
step ends: the peak is the state plus the changed tiers, not a merged copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dos_jax import partition as partition_lib
from dos_jax import paths
from dos_jax.partition import Tier
from dos_jax.partition import TIERS
from dos_jax.policies import Plan
from dos_jax.state import OffloadedState


def check_plan(plan: Plan, state: OffloadedState) -> None:
  """Raises a one-line error when `plan` is not a `Plan` for this state's subgroups."""
  if not isinstance(plan, Plan):
    raise TypeError(f'dos_jax: plan must be a dos_jax.Plan, got {type(plan).__name__}')
  if plan.num_subgroups != state.layout.num_subgroups:
    raise ValueError(
        f'dos_jax: the plan covers {plan.num_subgroups} subgroups but the state has'
        f' {state.layout.num_subgroups}'
    )


def migrate(state: OffloadedState, wanted: partition_lib.Partition,
            split: bool) -> OffloadedState:
  """`state` with its rows in the tiers of `wanted` (see the module docstring); `split`:
  host tiers are sliced inside host regions (the accelerator program). Device memory
  holds moved rows only when they become resident; the step's output constraints
  place the new tiers on the mesh."""
  old = state.partition
  region = paths.host_region if split else (lambda fn: fn)
  tiers = dict(state.tiers)
  for tier in TIERS:
    ids = wanted.ids(tier)
    if ids == old.ids(tier):
      continue
    dest = paths.DEVICE if tier is Tier.RESIDENT else paths.HOST
    segments = segments_of(old, ids)
    rebuilt = []
    for j, same in enumerate(state.tier(tier)):
      parts = []
      for src, start, stop in segments:
        x = state.tier(src)[j]
        take = lambda y, a=start, b=stop: y[a:b]
        part = take(x) if src is Tier.RESIDENT else region(take)(x)
        parts.append(jax.device_put(part, dest))
      if not parts:
        rebuilt.append(same[:0] if tier is Tier.RESIDENT else region(lambda y: y[:0])(same))
      elif len(parts) == 1:
        rebuilt.append(parts[0])
      elif tier is Tier.RESIDENT:
        rebuilt.append(jnp.concatenate(parts))
      else:
        rebuilt.append(region(lambda *p: jnp.concatenate(p))(*parts))
    tiers[tier] = tuple(rebuilt)
  return OffloadedState(
      host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
      scalars=state.scalars, layout=state.layout, slots=state.slots, partition=wanted)


def segments_of(old: partition_lib.Partition,
                ids: tuple[int, ...]) -> list[tuple[Tier, int, int]]:
  """`ids` (ascending subgroups of a new tier) as `(old tier, start row, stop row)` runs
  of rows that are consecutive in one old tier."""
  out: list[tuple[Tier, int, int]] = []
  for g in ids:
    src = old.tier_of(g)
    row = old.local(src, [g])[0]
    if out and out[-1][0] is src and out[-1][2] == row:
      out[-1] = (src, out[-1][1], row + 1)
    else:
      out.append((src, row, row + 1))
  return out
