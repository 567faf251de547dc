"""Stacked storage for the optimizer state: one `(G, K, S)` array per dtype.

The wrapped optax transforms see their usual state (`ScaleByAdamState(count, mu, nu)`,
...), but it is stored with all per-element leaves of one dtype stacked along a middle
axis, next to the fp32 master: fp32 master, `mu` and `nu` become one `(G, 3, S)` array.
The reason is XLA's in-place analysis: a loop that reads one subgroup of several
separate arrays and writes all of them back makes XLA:CPU copy the whole state at
every iteration, while one read and one write of a single stacked array per dtype is
done in place. Scalars (step counts) are stored apart: every subgroup of one step reads
the same pre-step value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Slots:
  """Where each leaf of `(master, inner_state)` is stored.

  Attributes:
    treedef: structure of the pair `(master or None, inner_state)`.
    places: per leaf, `(group, k)` for a per-element leaf (row `k` of stacked array
      `group`), or `(-1, i)` for the i-th scalar.
    groups: dtype name of each stacked array.
  """

  treedef: Any
  places: tuple[tuple[int, int], ...]
  groups: tuple[str, ...]

  @property
  def group_sizes(self) -> tuple[int, ...]:
    return tuple(sum(1 for g, _ in self.places if g == i) for i in range(len(self.groups)))


def build(full_state: PyTree, row_ndim: int) -> Slots:
  """Assigns slots to the leaves of `(master, inner_state)`; leaves with `row_ndim`
  dimensions are per-element, 0-d leaves are scalars."""
  leaves, treedef = jax.tree.flatten(full_state)
  groups: list[str] = []
  counts: dict[str, int] = {}
  places = []
  scalar_count = 0
  for leaf in leaves:
    if jnp.ndim(leaf) == 0:
      places.append((-1, scalar_count))
      scalar_count += 1
      continue
    if jnp.ndim(leaf) != row_ndim:
      raise TypeError(
          f'dos_jax: a wrapped transform keeps state of shape {jnp.shape(leaf)}, neither'
          ' per-element nor scalar; only element-wise transforms can be offloaded.'
      )
    name = jnp.dtype(leaf.dtype).name
    if name not in counts:
      counts[name] = 0
      groups.append(name)
    places.append((groups.index(name), counts[name]))
    counts[name] += 1
  return Slots(treedef=treedef, places=tuple(places), groups=tuple(groups))


def split(full_state: PyTree, slots: Slots, axis: int) -> tuple[tuple[jax.Array, ...], tuple]:
  """`(master, inner_state)` -> (stacked arrays, scalars); rows stack along `axis`."""
  leaves = slots.treedef.flatten_up_to(full_state)
  stacks: list[list[Any]] = [[None] * n for n in slots.group_sizes]
  scalars = []
  for leaf, (group, k) in zip(leaves, slots.places):
    if group < 0:
      scalars.append(leaf)
    else:
      stacks[group][k] = leaf.astype(slots.groups[group])
  return tuple(jnp.stack(s, axis=axis) for s in stacks), tuple(scalars)


def join(stacked: tuple[jax.Array, ...], scalars: tuple, slots: Slots, axis: int) -> PyTree:
  """(stacked arrays, scalars) -> `(master, inner_state)`; the inverse of `split`."""
  leaves = [
      scalars[k] if group < 0 else jax.lax.index_in_dim(stacked[group], k, axis, False)
      for group, k in slots.places
  ]
  return slots.treedef.unflatten(leaves)
