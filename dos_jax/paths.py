"""The two update paths of one optimizer step, and the resident (no-offload) baseline.

Every path applies one *row update* to subgroup rows of the packed state:

    row_update(grad_row, state_row, param_row, decayed) -> (update_row, new_state_row)

where `state_row` is the wrapped transforms' state for one subgroup and `decayed` says
whether the subgroup holds weight-decayed leaves. The paths differ in where the row's
state lives while it is updated:

* `device_stream`: subgroups in plan order are copied host -> device, updated, and
  copied back; the new parameter rows stay on the device. A `fori_loop` over the plan's
  rows keeps compile time independent of the number of subgroups, and its `unroll`
  (the plan's `buffers`) lets XLA overlap one subgroup's copies with another's update.
* `host_update`: gradients of the host rows are copied device -> host once, the update
  runs in host memory (`compute_on('device_host')` on accelerators), and only the new
  low-precision parameter rows go back to the device.
* `resident_update`: the state already lives in device memory and is updated in one
  vectorized pass, like plain optax.

In-place matters: rows are read with `dynamic_index_in_dim` and written back with
`dynamic_update_index_in_dim` on the loop carry, which XLA updates in place when the
state is donated, so no full copy of the state is ever made.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import compute_on as _compute_on_mod

RowUpdate = Callable[..., tuple[jax.Array, Any]]

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def to_space(tree: Any, space) -> Any:
  """Moves the non-scalar arrays of `tree` to a memory space (inside jit: an async copy).

  Scalar state (step counts) always stays in device memory: JAX lets scalars mix with
  arrays of either memory space, and optax wrappers (MultiSteps) recompute them there.
  """
  return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jax.device_put(x, space), tree)


def _is_row_leaf(x) -> bool:
  return x.ndim == 2


def _row(tree: Any, index) -> Any:
  """One subgroup's slice of the state: per-element leaves indexed, scalars (count) as is."""
  return jax.tree.map(
      lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False) if _is_row_leaf(x) else x,
      tree,
  )


def _set_row(tree: Any, row: Any, index) -> Any:
  """Writes one subgroup's per-element leaves back; scalar leaves keep the old value, since
  every row of one step must read the same (pre-step) scalars."""
  return jax.tree.map(
      lambda x, r: lax.dynamic_update_index_in_dim(x, r.astype(x.dtype), index, 0)
      if _is_row_leaf(x) else x,
      tree, row,
  )


def _scalars(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.ndim(x) == 0]


def with_scalars(tree: Any, scalars: list[jax.Array]) -> Any:
  """`tree` with its scalar leaves replaced, in order, by `scalars`."""
  leaves, treedef = jax.tree.flatten(tree)
  it = iter(scalars)
  return treedef.unflatten([next(it).astype(x.dtype) if jnp.ndim(x) == 0 else x for x in leaves])


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


def _apply(row_update, grad, state, master, params, decayed, out_dtype):
  """One subgroup row, or all rows at once: returns (out, new_state, new_master or None).

  The update rules are element-wise, so the same code serves a `(S,)` row and the whole
  `(G, S)` state; `decayed` is a scalar for a row and a `(G, 1)` column for all rows.
  """
  source = master if master is not None else params
  # Gradients travel in their own (often 16-bit) dtype and are upcast here, so the math
  # is optax's on the fp32 master with fp32 gradients.
  state_dtype = grad.dtype if source is None else source.dtype
  update, new_state = row_update(grad.astype(state_dtype), state, source, decayed)
  if master is None:
    return update.astype(out_dtype), new_state, None
  new_master = (master + update).astype(master.dtype)
  return new_master.astype(out_dtype), new_state, new_master


def device_stream(
    rows: tuple[int, ...],
    *,
    row_update: RowUpdate,
    inner: Any,
    master: jax.Array | None,
    grads: jax.Array,
    params: jax.Array | None,
    out: jax.Array,
    decayed_rows: int,
    buffers: int,
) -> tuple[Any, list[jax.Array], jax.Array | None, jax.Array]:
  """Streams `rows` of the host state through the device.

  Returns (inner, new_scalars, master, out): `inner` with the rows written back and its
  scalar leaves unchanged, and the post-step scalar leaves separately.
  """
  order = jnp.asarray(rows, jnp.int32)

  def body(i, carry):
    inner, _, master, out = carry
    g = order[i]
    state_row = to_space(_row(inner, g), DEVICE)
    master_row = None if master is None else jax.device_put(master[g], DEVICE)
    param_row = None if params is None else params[g]
    out_row, new_state, new_master = _apply(
        row_update, grads[g], state_row, master_row, param_row, g < decayed_rows, out.dtype
    )
    new_state = to_space(new_state, HOST)
    inner = _set_row(inner, new_state, g)
    if master is not None:
      master = lax.dynamic_update_index_in_dim(master, jax.device_put(new_master, HOST), g, 0)
    out = lax.dynamic_update_index_in_dim(out, out_row, g, 0)
    return inner, _scalars(new_state), master, out

  carry = (inner, _scalars(inner), master, out)
  return lax.fori_loop(0, len(rows), body, carry, unroll=max(1, min(buffers, len(rows))))


def host_update(
    rows: tuple[int, ...],
    *,
    row_update: RowUpdate,
    inner: Any,
    master: jax.Array | None,
    grads: jax.Array,
    params: jax.Array | None,
    out: jax.Array,
    decayed_rows: int,
) -> tuple[Any, list[jax.Array], jax.Array | None, jax.Array]:
  """Updates `rows` in host memory; returns (inner, new_scalars, master, out)."""
  num_subgroups = grads.shape[0]
  if rows == tuple(range(num_subgroups)):
    grads_h = jax.device_put(grads, HOST)
    params_h = None if params is None else jax.device_put(params, HOST)
    decayed = jax.device_put((jnp.arange(num_subgroups) < decayed_rows)[:, None], HOST)

    def whole(inner, master, grads_h, params_h, decayed):
      return _apply(row_update, grads_h, inner, master, params_h, decayed, out.dtype)

    out_h, inner, master = on_host(whole)(inner, master, grads_h, params_h, decayed)
    return inner, _scalars(inner), master, jax.device_put(out_h, DEVICE)

  order = jnp.asarray(rows, jnp.int32)
  grads_h = jax.device_put(grads[order], HOST)
  params_h = None if params is None else jax.device_put(params[order], HOST)
  order_h = jax.device_put(order, HOST)
  out_h = jax.device_put(jnp.zeros((len(rows), out.shape[1]), out.dtype), HOST)

  def loop(inner, master, grads_h, params_h, order_h, out_h):
    def body(j, carry):
      inner, _, master, out_h = carry
      g = order_h[j]
      master_row = None if master is None else master[g]
      param_row = None if params_h is None else params_h[j]
      out_row, new_state, new_master = _apply(
          row_update, grads_h[j], _row(inner, g), master_row, param_row, g < decayed_rows,
          out_h.dtype,
      )
      new_state = to_space(new_state, HOST)
      inner = _set_row(inner, new_state, g)
      if master is not None:
        master = lax.dynamic_update_index_in_dim(master, new_master, g, 0)
      out_h = lax.dynamic_update_index_in_dim(out_h, out_row, j, 0)
      return inner, _scalars(new_state), master, out_h

    return lax.fori_loop(0, len(rows), body, (inner, _scalars(inner), master, out_h))

  inner, scalars, master, out_h = on_host(loop)(inner, master, grads_h, params_h, order_h, out_h)
  out = out.at[order].set(jax.device_put(out_h, DEVICE))
  return inner, scalars, master, out


def resident_update(
    *,
    row_update: RowUpdate,
    inner: Any,
    master: jax.Array | None,
    grads: jax.Array,
    params: jax.Array | None,
    out_dtype,
    decayed_rows: int,
) -> tuple[Any, jax.Array | None, jax.Array]:
  """Updates a device-resident state in one pass; returns (inner, master, out)."""
  decayed = (jnp.arange(grads.shape[0]) < decayed_rows)[:, None]
  out, inner, master = _apply(row_update, grads, inner, master, params, decayed, out_dtype)
  return inner, master, out
