"""One subgroup row's update (`RowStep`) and the scalar state's (`scalar_update`).

The wrapped optax transforms' *row update*

    row_update(grad_row, state_row, param_row, decayed) -> (update_row, new_state_row)

is applied to one subgroup row at a time, by the loops of `tier_updates` (each path's:
streamed through the device, in a host region, resident in device memory). `RowStep`
passes each iteration's new block through an `optimization_barrier`, which makes every
read of the old row happen before the write and lets XLA update the donated state in
place instead of copying it at every iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from dos_jax.geometry import slots as slots_lib


class RowUpdate(Protocol):
  """The wrapped transforms' update of one subgroup row, and of their scalar state."""

  def __call__(self, grad_row, state_row, param_row, decayed) -> tuple[jax.Array, Any]:
    """`(update_row, new_state_row)`: the update of one row (`decayed`: whether the row
    holds weight-decayed leaves)."""

  def advance(self, inner_state, state_dtype) -> Any:
    """The state after one step, as far as its scalar leaves go (the rest unread)."""


@dataclasses.dataclass(frozen=True)
class RowStep:
  """Everything one subgroup update needs besides the arrays themselves."""

  row_update: RowUpdate
  slots: slots_lib.Slots
  has_master: bool
  decayed_rows: int
  state_dtype: Any
  out_dtype: Any
  # Multiplies every gradient first (the global-norm clip factor), in the state dtype;
  # None: no multiplication at all, so unclipped results stay bit for bit optax's.
  grad_scale: Any = None

  def __call__(self, blocks, scalars, grad, param, index):
    """Updates one row: returns (new_blocks, new_scalars, out_row)."""
    master, state = slots_lib.join(blocks, scalars, self.slots, axis=0)
    source = master if self.has_master else param
    # Gradients travel in their own (often 16-bit) dtype and are upcast here, so the
    # math is optax's on the fp32 master with fp32 gradients.
    grad = grad.astype(self.state_dtype)
    if self.grad_scale is not None:
      grad = grad * self.grad_scale
    update, new_state = self.row_update(grad, state, source, index < self.decayed_rows)
    if self.has_master:
      new_master = (master + update).astype(master.dtype)
      out_row = new_master.astype(self.out_dtype)
    else:
      new_master, out_row = None, update.astype(self.out_dtype)
    new_blocks, new_scalars = slots_lib.split((new_master, new_state), self.slots, axis=0)
    new_scalars = tuple(jnp.asarray(n, o.dtype) for n, o in zip(new_scalars, scalars))
    # See the module docstring: all reads of the old row before the in-place writes.
    # The out row rides in the same block through the barrier (exact: every out dtype
    # converts to the state dtype and back losslessly), so no consumer after the
    # barrier can be fused with a read of the old state.
    first = jnp.concatenate([new_blocks[0], out_row[None].astype(new_blocks[0].dtype)])
    first, *rest = lax.optimization_barrier((first, *new_blocks[1:]))
    new_blocks = (first[:-1], *rest)
    return new_blocks, new_scalars, first[-1].astype(self.out_dtype)


def scalar_update(step: RowStep, scalars: tuple) -> tuple[Any, Any, tuple]:
  """The wrapped transforms' scalar state before and after the step, and the new
  scalar leaves: `(inner state, new inner state, new scalars)`.

  Every row's update computes the same new scalars from the same pre-step values, so
  they are computed once per step, outside the paths, by the row update's `advance`
  (see `RowUpdate`); no path hands them to another. The state's per-element leaves
  are zero-length here: only its scalar leaves are read.
  """
  empty = tuple(jnp.zeros((n, 0), dtype) for n, dtype in
                zip(step.slots.group_sizes, step.slots.groups))
  master, inner_state = slots_lib.join(empty, scalars, step.slots, axis=0)
  new_inner = step.row_update.advance(inner_state, step.state_dtype)
  _, new_scalars = slots_lib.split((master, new_inner), step.slots, axis=0)
  new_scalars = tuple(jnp.asarray(n, o.dtype) for n, o in zip(new_scalars, scalars))
  return inner_state, new_inner, new_scalars
