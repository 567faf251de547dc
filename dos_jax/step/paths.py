"""The update paths of one optimizer step: streamed through the device, on the host,
or resident in device memory.

Every path runs a loop over the rows of one tier's state (see `partition`). One
iteration reads the row's block of each stacked state array (see `slots`), applies the
wrapped optax transforms' *row update*

    row_update(grad_row, state_row, param_row, decayed) -> (update_row, new_state_row)

and writes the new block back in place. The paths differ in where that happens:

* `streamed_loop` (one subgroup's block): the streamed rows are copied host -> device,
  updated, and copied back; the new low-precision parameter rows stay on the device.
  `buffers` blocks are in flight at once (`tier_updates`, `lanes`).
* `host_region_update`: the host tier's gradients arrive in host memory piece by piece
  (each piece leaves the device as soon as the backward pass has made it), the rows are
  assembled there and the loop runs in a `compute_on('device_host')` region; only the
  new low-precision parameter rows go back to the device.
* `resident_loop`: the state is where it is updated (resident in device memory, or any
  tier on a CPU backend).

A `fori_loop` keeps compile time independent of the number of subgroups. The
`optimization_barrier` on each iteration's new block makes every read of the old row
happen before the write, which lets XLA update the donated state in place instead of
copying it at every iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry import slots as slots_lib
from dos_jax.memory_spaces import DEVICE
from dos_jax.memory_spaces import HOST
from dos_jax.memory_spaces import host_region
from dos_jax.memory_spaces import put
from dos_jax.memory_spaces import to_host


class RowUpdate(Protocol):
  """The wrapped transforms' update of one subgroup row, and of their scalar state."""

  def __call__(self, grad_row, state_row, param_row, decayed) -> tuple[jax.Array, Any]:
    """`(update_row, new_state_row)`: the update of one row (`decayed`: whether the row
    holds weight-decayed leaves)."""

  def advance(self, inner_state, state_dtype) -> Any:
    """The state after one step, as far as its scalar leaves go (the rest unread)."""


def _row(x: jax.Array, i) -> jax.Array:
  return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _set_row(x: jax.Array, row: jax.Array, i) -> jax.Array:
  return lax.dynamic_update_index_in_dim(x, row.astype(x.dtype), i, 0)


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


def _row_index(order: tuple[int, ...], j):
  """The row updated at loop position `j` (a Python int or a traced one)."""
  if isinstance(j, int):
    return order[j]
  if order == tuple(range(len(order))):
    return j
  return jnp.asarray(order, jnp.int32)[j]


def _update_row(step: RowStep, i, blocks, *, stacked, scalars, grads, params, out,
                to_space=None):
  """Row `i`'s update from its state `blocks`, written into `stacked` and `out`
  (through `to_space` first, when the row came from another memory)."""
  param = None if params is None else _row(params, i)
  new_blocks, _, out_row = step(blocks, scalars, _row(grads, i), param, i)
  if to_space is not None:
    new_blocks = put(new_blocks, to_space)
  stacked = tuple(_set_row(x, b, i) for x, b in zip(stacked, new_blocks))
  return stacked, _set_row(out, out_row, i)


def resident_loop(order: Sequence[int], step: RowStep, *, stacked, scalars, grads, params,
                  out):
  """Updates the rows `order` of a tier where its state is (resident in device memory,
  or any tier of a CPU program); returns (stacked, out).

  `grads`, `params` and `out` are the tier's `(R, S)` rows.
  """
  order = tuple(order)

  def body(j, carry):
    i = _row_index(order, j)
    blocks = tuple(_row(x, i) for x in carry[0])
    return _update_row(step, i, blocks, stacked=carry[0], scalars=scalars, grads=grads,
                       params=params, out=carry[1])

  return lax.fori_loop(0, len(order), body, (stacked, out))


def streamed_loop(order: Sequence[int], step: RowStep, *, stacked, scalars, grads, params,
                  out):
  """Updates the rows `order` of a streamed block, whose state stays in host memory:
  each row is copied host -> device, updated, and copied back, one after the other;
  returns (stacked, out).

  For a block of one row: `tier_updates` and `lanes` chain the blocks `buffers` deep.
  """
  order = tuple(order)

  def body(j, carry):
    stacked, out = carry
    i = _row_index(order, j)
    blocks = put(tuple(_row(x, i) for x in stacked), DEVICE)
    return _update_row(step, i, blocks, stacked=stacked, scalars=scalars, grads=grads,
                       params=params, out=out, to_space=HOST)

  return lax.fori_loop(0, len(order), body, (stacked, out))


def host_region_update(step: RowStep, *, stacked, scalars, grad_pieces, param_pieces, runs,
                       grad_dtype, inputs_sink: list | None = None, shards: int = 1):
  """Updates every row of the host tier in a `compute_on('device_host')` region (the
  two-memory program's XLA host path); returns (stacked, out rows in host memory).

  Args:
    step: the row update, with the tier's own `decayed_rows`.
    stacked: the host tier's `(R, K, S)` arrays, in host memory.
    scalars: the pre-step scalars.
    grad_pieces: the tier's gradient pieces (`partition.Piece` runs), in host memory.
    param_pieces: likewise for fp32 params (no master), or None.
    runs: the `partition.Piece`s the arrays belong to.
    grad_dtype: dtype the gradient rows are assembled in.
    inputs_sink: where to append the region's inputs other than the state.
    shards: the pieces' shards (`partition.assemble`): > 1 for a shard-major layout.
  """
  num_rows, _, size = stacked[0].shape
  out_dtype = step.out_dtype
  # Every input of a host region must already be in host memory.
  scale = step.grad_scale
  scalars, scale = to_host(scalars), None if scale is None else to_host(scale)

  def update(stacked, scalars, grad_pieces, param_pieces, scale):
    grads = partition_lib.assemble(grad_pieces, runs, num_rows, size, grad_dtype, shards)
    params = None
    if param_pieces is not None:
      params = partition_lib.assemble(param_pieces, runs, num_rows, size, step.state_dtype,
                                      shards)
    # The out buffer is made from a host array (a zeros constant would be device
    # memory); every row of it is overwritten.
    out = grads.astype(out_dtype)
    return resident_loop(tuple(range(num_rows)), dataclasses.replace(step, grad_scale=scale),
                         stacked=stacked, scalars=scalars, grads=grads, params=params,
                         out=out)

  if inputs_sink is not None:
    # Everything the region reads but the state (see `tier_updates.StepContext.gate`).
    inputs_sink.extend(jax.tree.leaves((scalars, grad_pieces, param_pieces, scale)))
  return host_region(update)(stacked, scalars, grad_pieces, param_pieces, scale)
