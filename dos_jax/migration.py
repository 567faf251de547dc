"""Plan changes: checking a plan against a state, and moving rows between the tiers.

A new plan (from `Auto`, or `plan=` naming another split) changes which tier each
subgroup's row lives in. `dos_jax.migrate(opt_state, plan)` moves the rows, between
steps: a step whose plan needs other tiers than its state has refuses to trace (a
donated step would otherwise pair a host-memory input buffer with a device-memory output
of the same shape, which the runtime rejects by aborting). What a move costs depends on
the program:

* The two-memory program stores every row as its own buffer. A row whose memory stays
  the same (host <-> streamed, both in pinned host memory) is handed to its new tier as
  it is, the same array; a row that moves between host and device memory is copied
  once, to where it goes. Nothing else is copied: the memory a plan change adds is the
  moved rows, and their old buffers are freed with the old state.
* The one-memory program keeps one array; it changes tier only when a plan keeps every
  subgroup resident or stops doing so, and is then rebuilt in one jitted program.

The early host calls (`Partition.early`) are part of what a state is laid out for: a
`migrate` that names other ones changes the static state only, and the next step is
traced again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dos_jax.geometry import partition as partition_lib
from dos_jax import memory_spaces
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.partition import TIERS
from dos_jax.policies import Plan
from dos_jax.geometry import state as state_lib
from dos_jax.geometry.state import OffloadedState


def check_plan(plan: Plan, state: OffloadedState) -> None:
  """Raises a one-line error when `plan` is not a `Plan` for this state's subgroups."""
  if not isinstance(plan, Plan):
    raise TypeError(f'dos_jax: plan must be a dos_jax.Plan, got {type(plan).__name__}')
  if plan.num_subgroups != state.layout.num_subgroups:
    raise ValueError(
        f'dos_jax: the plan covers {plan.num_subgroups} subgroups but the state has'
        f' {state.layout.num_subgroups}'
    )


def migrate(opt_state: Any, plan: Plan, *, early: tuple[int, ...] | None = None) -> Any:
  """`opt_state` with every `OffloadedState` in it laid out for `plan`.

  Call it between steps when the plan changes (the runner does, for `Auto`): the step
  that then runs finds its tiers in place. `early`: the two-memory program's early host
  calls (`Partition.early`, e.g. a cost model's `timeline.choose_early_calls`); None
  keeps the state's where its tiers stay, else takes the fixed rule. When nothing
  changes, `opt_state` itself is returned. See the module docstring for what is copied.

  >>> import jax, jax.numpy as jnp, dos_jax
  >>> opt = dos_jax.adamw(
  ...     1e-3, offload=dos_jax.Offload(policy=dos_jax.AllHost(), subgroup_size=4),
  ...     implementation=dos_jax.Implementation(program='gpu'))
  >>> params = jax.device_put({'w': jnp.zeros(16)}, jax.devices()[0])
  >>> state = opt.init(params)
  >>> state.partition.early
  (1, 1, 1)
  >>> dos_jax.migrate(state, state.partition.plan, early=(2,)).partition.early
  (2,)
  """
  is_state = lambda x: isinstance(x, OffloadedState)
  states, treedef = jax.tree.flatten(opt_state, is_leaf=is_state)
  moved = [migrate_state(x, plan, early) if is_state(x) else x for x in states]
  if all(a is b for a, b in zip(moved, states)):
    return opt_state  # nothing to move: the same object, so callers can tell
  return treedef.unflatten(moved)


def partition_for(plan: Plan, state: OffloadedState,
                  early: tuple[int, ...] | None = None) -> partition_lib.Partition:
  """The partition `plan` runs on, in the program of `state`, with `early` host calls
  (None: the state's where the tiers stay as they are, else the fixed rule)."""
  old = state.partition
  new = partition_lib.for_plan(plan, old.two_memories, early=early, disk=old.spill)
  if early is None and dataclasses.replace(new, early=old.early) == old:
    return old
  return new


def migrate_state(state: OffloadedState, plan: Plan,
                  early: tuple[int, ...] | None = None) -> OffloadedState:
  """One state laid out for `plan` (see `migrate`); traced, the moves are part of the
  program being traced."""
  check_plan(plan, state)
  wanted = partition_for(plan, state, early)
  if wanted == state.partition:
    return state
  if wanted.disk != state.partition.disk:
    raise ValueError(
        f'dos_jax: the plan ({plan.describe()}) moves subgroups between disk and memory '
        f'(disk {state.partition.disk} -> {wanted.disk}); restore a checkpoint into a '
        'state built with the new plan instead')
  if all(wanted.blocks(t) == state.partition.blocks(t) for t in TIERS):
    return state.with_tiers(state.tiers, wanted)  # the schedule alone changes
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    return moved_in_trace(state, wanted)
  if wanted.two_memories:
    return _move_blocks(state, wanted)
  return _rebuild_concrete(state, wanted)


def moved_in_trace(state: OffloadedState, wanted: partition_lib.Partition) -> OffloadedState:
  """`state` with its rows in the tiers of `wanted`, as ops of the program being traced
  (see the module docstring)."""
  if wanted.two_memories:
    return _move_blocks(state, wanted)
  return _rebuild(state, wanted)


def _rebuild_concrete(state: OffloadedState, wanted: partition_lib.Partition) -> OffloadedState:
  """The one-memory program's single array, between steps: the changed tiers rebuilt by one jitted program,
  the others handed over as they are."""
  old = state.partition
  changed = tuple(t for t in TIERS if wanted.blocks(t) != old.blocks(t))
  template = next(x.sharding for x in jax.tree.leaves(state.tiers) if x.ndim == 3)
  width = len(state.slots.groups)
  shardings = tuple((t, tuple(template.with_memory_kind(t.memory_kind)
                              for _ in range(width * len(wanted.blocks(t)))))
                    for t in changed)
  new = _rebuild_program(wanted, shardings)(state)
  return state.with_tiers({t: new.get(t, state.tier(t)) for t in TIERS}, wanted)


@functools.lru_cache(maxsize=64)
def _rebuild_program(wanted: partition_lib.Partition, shardings: tuple) -> Callable:
  """The jitted rebuild of the changed tiers (named with their output shardings in
  `shardings`): one program per plan change, compiled once."""
  changed = tuple(t for t, _ in shardings)
  return jax.jit(lambda s: {t: _rebuild(s, wanted).tier(t) for t in changed},
                 out_shardings=dict(shardings))


def _rebuild(state: OffloadedState, wanted: partition_lib.Partition) -> OffloadedState:
  """One array per tier: the changed tiers' blocks rebuilt from runs of consecutive rows
  (host tiers sliced inside host regions in the two-memory program). Device memory
  holds moved rows only when they become resident."""
  old = state.partition
  region = memory_spaces.host_region if wanted.two_memories else (lambda fn: fn)
  old_blocks = {t: partition_lib.blocks_of(state.tier(t), len(old.blocks(t))) for t in TIERS}
  tiers = dict(state.tiers)
  for tier in TIERS:
    if wanted.blocks(tier) == old.blocks(tier):
      continue
    dest = memory_spaces.DEVICE if tier is Tier.RESIDENT else memory_spaces.HOST
    rebuilt = []
    for ids in wanted.blocks(tier):
      segments = segments_of(old, ids)
      for j in range(len(state.slots.groups)):
        parts = []
        for src, block, start, stop in segments:
          x = old_blocks[src][block][j]
          take = lambda y, a=start, b=stop: y[a:b]
          part = take(x) if src is Tier.RESIDENT else region(take)(x)
          parts.append(jax.device_put(part, dest))
        if not parts:
          same = old_blocks[tier][0][j]
          rebuilt.append(same[:0] if tier is Tier.RESIDENT else region(lambda y: y[:0])(same))
        elif len(parts) == 1:
          rebuilt.append(parts[0])
        elif tier is Tier.RESIDENT:
          rebuilt.append(jnp.concatenate(parts))
        else:
          rebuilt.append(region(lambda *p: jnp.concatenate(p))(*parts))
    tiers[tier] = tuple(rebuilt)
  return state.with_tiers(tiers, wanted)


def _move_blocks(state: OffloadedState, wanted: partition_lib.Partition) -> OffloadedState:
  """Per-subgroup storage: each row's block handed to its new tier, copied into that
  tier's memory only when its memory changes (see the module docstring)."""
  old = state.partition
  rows = dict(zip([g for g in range(old.num_subgroups) if g not in old.disk],
                  state.by_subgroup()))
  tiers = {}
  for tier in TIERS:
    arrays = []
    for (g,) in wanted.blocks(tier):
      block = rows[g]
      if (old.tier_of(g) is Tier.RESIDENT) != (tier is Tier.RESIDENT):
        block = tuple(state_lib.to_memory(x, tier) for x in block)
      arrays.extend(block)
    tiers[tier] = tuple(arrays)
  return state.with_tiers(tiers, wanted)


def segments_of(old: partition_lib.Partition,
                ids: tuple[int, ...]) -> list[tuple[Tier, int, int, int]]:
  """`ids` (ascending subgroups of a new block) as `(old tier, block, start row, stop
  row)` runs of rows that are consecutive in one old block."""
  out: list[tuple[Tier, int, int, int]] = []
  for g in ids:
    src, block, row = old.locate(g)
    if out and out[-1][:2] == (src, block) and out[-1][3] == row:
      out[-1] = (src, block, out[-1][2], row + 1)
    else:
      out.append((src, block, row, row + 1))
  return out
