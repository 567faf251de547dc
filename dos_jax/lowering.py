"""How the two-memory program's stream regions are laid out on the JAX installed: the
one version-dependent choice of the construction (`Construction.lowering`), which the
planner reads too (`regions_hold_every_row`) without importing the step."""

from __future__ import annotations

import enum

import jax


class Lowering(enum.Enum):
  """How the device tiers' stream regions are laid out, by what the JAX version's XLA
  accepts inside a stream region (docs/design.md, "One construction", per version).

  * `IN_REGION` (jax 0.10, 0.11): one region per lane holding all its rows, each row's
    fetch gated inside the region by an optimization barrier on the previous row's
    write-back; the lanes grouped with the last host call.
  * `STAGED` (jax 0.12 and later, whose XLA runs stream regions on its parallel
    execution thread, where no optimization barrier may stand and constants are not
    emitted): one region per lane and stage, holding only the rows' copies and the
    Pallas kernel, each stage grouped with a host call of its own; stage s+1 of a lane
    waits for stage s through a barrier outside the regions.
  """

  IN_REGION = 'in_region'
  STAGED = 'staged'


CHECKED_VERSIONS = ((0, 10), (0, 11), (0, 12))  # whose compiled schedule the tests read


def of_version(version: tuple[int, ...] | None = None) -> Lowering:
  """The stream-region layout for jax `version` (default: the one installed).

  >>> of_version((0, 11, 2)), of_version((0, 12, 0))
  (<Lowering.IN_REGION: 'in_region'>, <Lowering.STAGED: 'staged'>)
  """
  version = jax.__version_info__ if version is None else version
  return Lowering.IN_REGION if tuple(version[:2]) <= (0, 11) else Lowering.STAGED


def checked(version: tuple[int, ...] | None = None) -> bool:
  """Whether jax `version`'s GPU schedule of the construction is one the compiled
  tests have read (`CHECKED_VERSIONS`)."""
  version = jax.__version_info__ if version is None else version
  return tuple(version[:2]) in CHECKED_VERSIONS


def regions_hold_every_row() -> bool:
  """Whether the device tiers' stream regions hold every streamed row of their lane at
  once (`Lowering.IN_REGION`; staged, a region holds one row): what the planner counts
  as the stream's device memory (`planner.stream_memory`)."""
  return of_version() is Lowering.IN_REGION
