"""The update paths of one optimizer step: streamed through the device, on the host,
or resident in device memory.

Every path runs the same loop over subgroup rows. One iteration reads the row's block
of each stacked state array (see `slots`), applies the wrapped optax transforms'
*row update*

    row_update(grad_row, state_row, param_row, decayed) -> (update_row, new_state_row)

and writes the new block back in place. The paths differ in where that happens:

* `device_stream`: the row's state is copied host -> device, updated, and copied back;
  the new low-precision parameter row stays on the device. The loop's `unroll` (the
  plan's `buffers`) lets XLA overlap one row's copies with another row's update.
* `host_update`: gradients of the host rows are copied device -> host once, the loop
  runs in host memory (`compute_on('device_host')` on accelerators), and only the new
  low-precision parameter rows go back to the device.
* `resident`: the state already lives in device memory (the `AllDevice` baseline).

A `fori_loop` keeps compile time independent of the number of subgroups. The
`optimization_barrier` on each iteration's new block makes every read of the old row
happen before the write, which lets XLA update the donated state in place instead of
copying it at every iteration.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import compute_on as _compute_on_mod

from dos_jax import slots as slots_lib

RowUpdate = Callable[..., tuple[jax.Array, Any]]

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Runs `fn` as a host computation on accelerators; a plain call on a CPU backend.

  jax 0.10 spells it as a context manager `compute_on('device_host')`; jax 0.11 as a
  function transform `compute_on(fn, compute_type=...)`.
  """
  if jax.default_backend() == 'cpu':
    return fn
  compute_on = _compute_on_mod.compute_on
  if 'compute_type' in inspect.signature(compute_on).parameters:
    return compute_on(fn, compute_type='device_host')

  @functools.wraps(fn)
  def wrapped(*args):
    with compute_on('device_host'):
      return fn(*args)

  return wrapped


def put(tree: Any, space) -> Any:
  """Copies every array of `tree` to a memory space (inside jit: an async copy)."""
  return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def to_host(tree: Any) -> Any:
  """Copies every array of `tree` to host memory (inside jit: an async D2H copy)."""
  return put(tree, HOST)


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

  def __call__(self, blocks, scalars, grad, param, index):
    """Updates one row: returns (new_blocks, new_scalars, out_row)."""
    master, state = slots_lib.join(blocks, scalars, self.slots, axis=0)
    source = master if self.has_master else param
    # Gradients travel in their own (often 16-bit) dtype and are upcast here, so the
    # math is optax's on the fp32 master with fp32 gradients.
    update, new_state = self.row_update(
        grad.astype(self.state_dtype), state, source, index < self.decayed_rows)
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


def device_stream(rows, step: RowStep, *, stacked, scalars, grads, params, out, buffers,
                  stream: bool = True):
  """Updates `rows` through device memory; returns (stacked, new_scalars, out).

  With `stream=False` the state is already in device memory (the resident baseline).
  """
  order = jnp.asarray(rows, jnp.int32)

  def body(j, carry):
    stacked, _, out = carry
    i = order[j]
    blocks = tuple(_row(x, i) for x in stacked)
    if stream:
      blocks = put(blocks, DEVICE)
    param = None if params is None else _row(params, i)
    new_blocks, new_scalars, out_row = step(blocks, scalars, _row(grads, i), param, i)
    if stream:
      new_blocks = put(new_blocks, HOST)
    stacked = tuple(_set_row(x, b, i) for x, b in zip(stacked, new_blocks))
    return stacked, new_scalars, _set_row(out, out_row, i)

  carry = (stacked, scalars, out)
  unroll = max(1, min(buffers, len(rows)))
  return lax.fori_loop(0, len(rows), body, carry, unroll=unroll)


def host_update(rows, step: RowStep, *, stacked, scalars, grads, params, out):
  """Updates `rows` in host memory; returns (stacked, new_scalars, out)."""
  everything = rows == tuple(range(grads.shape[0]))
  order = jnp.asarray(rows, jnp.int32)
  # Only the host rows' gradients (and params, when there is no master) cross over.
  grads_h = jax.device_put(grads if everything else grads[order], HOST)
  params_h = None
  if params is not None:
    params_h = jax.device_put(params if everything else params[order], HOST)
  order_h = jax.device_put(order, HOST)
  out_h = jax.device_put(jnp.zeros((len(rows), out.shape[1]), out.dtype), HOST)

  def loop(stacked, scalars, grads_h, params_h, order_h, out_h):
    def body(j, carry):
      stacked, _, out_h = carry
      i = order_h[j]
      blocks = tuple(_row(x, i) for x in stacked)
      param = None if params_h is None else _row(params_h, j)
      new_blocks, new_scalars, out_row = step(blocks, scalars, _row(grads_h, j), param, i)
      stacked = tuple(_set_row(x, b, i) for x, b in zip(stacked, put(new_blocks, HOST)))
      return stacked, new_scalars, _set_row(out_h, out_row, j)

    return lax.fori_loop(0, len(rows), body, (stacked, scalars, out_h))

  stacked, new_scalars, out_h = on_host(loop)(
      stacked, scalars, grads_h, params_h, order_h, out_h)
  out_d = jax.device_put(out_h, DEVICE)
  out = out_d if everything else out.at[order].set(out_d)
  return stacked, new_scalars, out
