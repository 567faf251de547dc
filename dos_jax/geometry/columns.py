"""A block's pieces in runs of columns: the host regions of one host subgroup under the
staged lowering (`Construction.host_columns`)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Sequence

from dos_jax.geometry.partition import Piece

COLUMN_ALIGN = 256  # a column part of a row starts this many elements into its piece


def split_pieces(runs: Sequence[Piece], parts: int) -> tuple[tuple[Piece, ...], ...]:
  """`runs` (a block's pieces) in up to `parts` runs of columns of near-equal size, in
  row order: part k ends at `total * k // parts` elements, moved back to a multiple of
  `COLUMN_ALIGN` elements into the piece it cuts, so that the kernel's vector loop
  meets the same alignment in each part as in the whole. Fewer parts where the runs
  are too short; none empty.

  >>> runs = (Piece(leaf=0, start=0, size=1000, offset=0),
  ...         Piece(leaf=1, start=24, size=200, offset=1000))
  >>> [[(p.leaf, p.start, p.size) for p in part] for part in split_pieces(runs, 2)]
  [[(0, 0, 512)], [(0, 512, 488), (1, 24, 200)]]
  """
  runs = sorted(runs, key=lambda run: run.offset)
  starts = list(itertools.accumulate([0] + [run.size for run in runs]))
  total = starts[-1]
  cuts = set()
  for k in range(1, parts):
    at = total * k // parts
    i = min(bisect.bisect_right(starts, at) - 1, len(runs) - 1)  # the run the cut is in
    cuts.add(starts[i] + (at - starts[i]) // COLUMN_ALIGN * COLUMN_ALIGN)
  cuts = {c for c in cuts if 0 < c < total}
  out: list[list[Piece]] = [[]]
  for run, begin in zip(runs, starts):
    end = begin + run.size
    for cut in sorted(c for c in cuts if begin < c <= end) + [end]:
      if cut > begin:
        take = cut - begin
        out[-1].append(dataclasses.replace(run, size=take))
        run = dataclasses.replace(run, start=run.start + take, size=run.size - take,
                                  offset=run.offset + take)
        begin = cut
      if cut in cuts and out[-1]:
        out.append([])
  return tuple(tuple(part) for part in out if part)
