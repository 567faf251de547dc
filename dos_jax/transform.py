"""The offloaded optax transforms: `chain` and `adamw`.

`offloaded(inner, offload)` turns an element-wise optax transform into one whose state
is packed into `(G, S)` subgroups in host memory (see `layout`), and whose update runs
each subgroup on the host or on the device according to a `Plan` (see `paths`). The
wrapped transform's own `update` is what runs on each subgroup row, so the math is
optax's, op for op.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import fused as fused_lib
from dos_jax import layout as layout_lib
from dos_jax import paths
from dos_jax import slots as slots_lib
from dos_jax.offload import Offload
from dos_jax.offload import UpdateImpl
from dos_jax.policies import Plan

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadedState:
  """State of an offloaded transform.

  Attributes:
    stacked: the per-element state, one `(G, K, S)` array per dtype (see `slots`): the
      fp32 master (kept only for lower-precision params) and the wrapped transforms'
      moments. In `pinned_host` memory (device memory under `AllDevice`).
    scalars: the wrapped transforms' scalar state (step counts), shared by every
      subgroup since all subgroups take every step together; in device memory.
    layout: how parameters map onto subgroups (static metadata).
    slots: where each state leaf is stored (static metadata).
    resident: whether the state lives in device memory (static metadata).
  """

  stacked: tuple[jax.Array, ...]
  scalars: tuple[jax.Array, ...]
  layout: layout_lib.Layout = dataclasses.field(metadata=dict(static=True))
  slots: slots_lib.Slots = dataclasses.field(metadata=dict(static=True))
  resident: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def unstacked(self) -> tuple[jax.Array | None, Any]:
    """`(master, inner_state)` as the wrapped transforms define it, with `(G, S)`
    leaves. A copy in device memory: for inspection and checkpoints, not for the
    training step."""
    stacked = tuple(_to_device_memory(x) for x in self.stacked)
    return slots_lib.join(stacked, self.scalars, self.slots, axis=1)

  @property
  def inner(self) -> Any:
    """The wrapped transforms' state (e.g. `inner[0].mu`), unstacked; see `unstacked`."""
    return self.unstacked()[1]

  @property
  def master(self) -> jax.Array | None:
    """The `(G, S)` fp32 master weights, or None when params are fp32; a copy."""
    return self.unstacked()[0]


def _to_device_memory(x: jax.Array) -> jax.Array:
  if isinstance(x, jax.core.Tracer):
    return jax.device_put(x, paths.DEVICE)
  return jax.device_put(x, x.sharding.with_memory_kind('device'))


class _Placement(NamedTuple):
  """Where state leaves go: per-element rows and per-subgroup scalars."""

  rows: Any
  scalars: Any


def _find_mesh(params: PyTree, offload: Offload):
  if offload.mesh is not None:
    return offload.mesh
  for leaf in jax.tree.leaves(params):
    try:
      sharding = leaf.sharding
    except Exception:  # pylint: disable=broad-except  # tracers have no concrete sharding
      return None
    if isinstance(sharding, NamedSharding) and offload.data_axis in sharding.mesh.shape:
      return sharding.mesh
  return None


def _placement(mesh, offload: Offload, resident: bool) -> _Placement:
  if mesh is None:
    return _Placement(rows=paths.DEVICE if resident else paths.HOST, scalars=paths.DEVICE)
  kind = 'device' if resident else 'pinned_host'
  return _Placement(
      rows=NamedSharding(mesh, P(None, None, offload.data_axis), memory_kind=kind),
      scalars=NamedSharding(mesh, P(), memory_kind='device'),
  )


def _place(tree: PyTree, placement: _Placement, constrain: bool = False) -> PyTree:
  def put(x):
    target = placement.rows if jnp.ndim(x) == 3 else placement.scalars
    if constrain and isinstance(target, NamedSharding):
      return jax.lax.with_sharding_constraint(x, target)
    return jax.device_put(x, target)

  return jax.tree.map(put, tree)


def _common_dtype(leaves, fallback) -> jnp.dtype:
  dtypes = {jnp.result_type(x) for x in leaves}
  return jnp.dtype(dtypes.pop()) if len(dtypes) == 1 else jnp.dtype(fallback)


def offloaded(
    inner: optax.GradientTransformationExtraArgs,
    offload: Offload | None = None,
    *,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    validate: Callable[[PyTree], None] | None = None,
    fused: fused_lib.FusedAdamW | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs an element-wise optax transform on host-resident subgroups.

  Args:
    inner: an element-wise transform; its update is applied to each subgroup row with
      the extra keyword `row_decayed` (whether the row holds weight-decayed leaves).
    offload: subgroup size, placement policy, mesh; `None` means `Offload()`.
    mask: weight-decay mask (pytree or callable) used to group decayed leaves.
    validate: called with the params at `init`, to reject unsupported transforms early.
    fused: set when `inner` is AdamW's chain (see `fused.FusedAdamW`): the host path
      may then run as one native call (`offload.host_impl`, see `fused.usable`).

  Returns:
    A transform whose update also accepts `plan=` (a `Plan`, static under jit) to
    override the policy's plan for this step.
  """
  offload = Offload() if offload is None else offload
  shardings_by_layout: dict[layout_lib.Layout, tuple[Any, tuple[Any, ...]]] = {}

  def row_update(grad, state, param, decayed):
    return inner.update(grad, state, param, row_decayed=decayed)

  def init_fn(params):
    if validate is not None:
      validate(params)
    mesh = _find_mesh(params, offload)
    shard_multiple = mesh.shape[offload.data_axis] if mesh is not None else 1
    layout = layout_lib.make_layout(
        params,
        offload.subgroup_size,
        decay_flags=layout_lib.resolve_mask(mask, params),
        shard_multiple=shard_multiple,
    )
    if mesh is not None:
      param_shardings = tuple(
          getattr(leaf, 'sharding', None) for leaf in layout.treedef.flatten_up_to(params)
      )
      shardings_by_layout[layout] = (mesh, param_shardings)
    resident = offload.policy.plan(layout.spec()).resident
    placement = _placement(mesh, offload, resident)

    def full_state(params):
      master = layout_lib.pack(params, layout, layout.state_dtype)
      # Element-wise transforms initialize every element alike (zeros, a constant), so
      # one row's state broadcast over the rows is the whole state, built where the
      # master is (optax's zeros_like would create it in device memory).
      row_state = inner.init(master[0])
      space = paths.DEVICE if resident else paths.HOST
      state = jax.tree.map(
          lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(
              jax.device_put(x, space), master.shape), row_state)
      return master if layout.needs_master else None, state

    slots = slots_lib.build(jax.eval_shape(full_state, params), row_ndim=2)

    def build(params):
      # The state is created where it lives: for an offloaded state the params are
      # copied to host memory and packed there, so the device never holds 12 bytes per
      # parameter, not even during init.
      def stacked_state(params):
        return slots_lib.split(full_state(params), slots, axis=1)

      if resident:
        stacked, scalars = stacked_state(params)
      else:
        # 0-d leaves would drop their memory space (JAX exempts scalars); packing
        # ravels every leaf anyway.
        params_1d = jax.tree.map(jnp.atleast_1d, params)
        stacked, scalars = paths.on_host(stacked_state)(paths.to_host(params_1d))
      return _place(stacked, placement), _place(scalars, placement)

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
    stacked, scalars = build(params) if traced else jax.jit(build)(params)
    return OffloadedState(
        stacked=stacked, scalars=scalars, layout=layout, slots=slots, resident=resident)

  def update_fn(updates, state: OffloadedState, params=None, *, plan: Plan | None = None,
                **extra_args):
    del extra_args
    if not isinstance(state, OffloadedState):
      raise TypeError(f'dos_jax: expected an OffloadedState, got {type(state).__name__}')
    layout = state.layout
    if plan is None:
      plan = offload.policy.plan(layout.spec())
    _check_plan(plan, state)
    if params is None and layout.needs_master:
      raise ValueError(
          'dos_jax: params are required: updates are computed against the fp32 master.'
      )
    grad_leaves = layout.treedef.flatten_up_to(updates)
    grads = layout_lib.pack(updates, layout, _common_dtype(grad_leaves, layout.state_dtype))
    param_rows = None
    if not layout.needs_master and params is not None:
      param_rows = layout_lib.pack(params, layout, layout.state_dtype)
    out_dtype = layout.lowp_dtype if layout.needs_master else jnp.dtype(layout.state_dtype)
    step = paths.RowStep(
        row_update=row_update, slots=state.slots, has_master=layout.needs_master,
        decayed_rows=layout.decayed_rows, state_dtype=jnp.dtype(layout.state_dtype),
        out_dtype=out_dtype)
    arrays = dict(stacked=state.stacked, scalars=state.scalars, grads=grads, params=param_rows)
    out = _empty_out(layout, out_dtype)
    new_scalars = state.scalars
    device_rows, host_rows = plan.device, plan.host
    native = fused_lib.usable(fused, offload, step, arrays['stacked'], grad_leaves,
                              sharded=layout in shardings_by_layout)
    if native and fused_lib.one_memory() and offload.device_impl == UpdateImpl.KERNEL:
      # Device memory is host memory here (a CPU backend): the device rows take the
      # same native call as the host rows, rather than a loop that copies them to
      # where they already are.
      device_rows, host_rows = (), tuple(sorted(plan.device + plan.host))
    if device_rows:
      device_step = step
      if fused_lib.device_usable(fused, offload, step, arrays['stacked']):
        device_step = fused_lib.device_step(fused, step, state.scalars)
      stacked, new_scalars, out = paths.device_stream(
          device_rows, device_step, out=out, buffers=plan.buffers, stream=not plan.resident,
          **arrays)
      arrays['stacked'] = stacked
    if host_rows and native:
      leaves = fused_lib.Leaves(
          grads=grad_leaves, offsets=layout.offsets,
          params=None if params is None else layout.treedef.flatten_up_to(params))
      stacked, new_scalars, out = fused_lib.host_update(
          host_rows, step, fused, out=out, num_threads=offload.host_threads, leaves=leaves,
          resident=plan.resident, **arrays)
      arrays['stacked'] = stacked
    elif host_rows:
      stacked, new_scalars, out = paths.host_update(host_rows, step, out=out, **arrays)
      arrays['stacked'] = stacked
    stacked = arrays['stacked']
    scalars = tuple(jax.device_put(x, paths.DEVICE) for x in new_scalars)
    new_updates = _updates_from_rows(out, layout, params)
    mesh_info = shardings_by_layout.get(layout)
    if mesh_info is not None:
      mesh, param_shardings = mesh_info
      placement = _placement(mesh, offload, state.resident)
      # Inside jit a device_put to the same memory kind is a no-op that sharding
      # propagation may override; a constraint pins the ZeRO-1 layout.
      stacked = _place(stacked, placement, constrain=True)
      scalars = _place(scalars, placement, constrain=True)
      new_updates = _constrain_like(new_updates, layout, param_shardings)
    return new_updates, OffloadedState(
        stacked=stacked, scalars=scalars, layout=layout, slots=state.slots,
        resident=state.resident)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _empty_out(layout: layout_lib.Layout, dtype) -> jax.Array:
  return jnp.zeros((layout.num_subgroups, layout.subgroup_size), dtype)


def _check_plan(plan: Plan, state: OffloadedState) -> None:
  if not isinstance(plan, Plan):
    raise TypeError(f'dos_jax: plan must be a dos_jax.Plan, got {type(plan).__name__}')
  if plan.num_subgroups != state.layout.num_subgroups:
    raise ValueError(
        f'dos_jax: the plan covers {plan.num_subgroups} subgroups but the state has'
        f' {state.layout.num_subgroups}'
    )
  if plan.resident != state.resident:
    where = 'device' if state.resident else 'pinned_host'
    raise ValueError(
        f'dos_jax: plan.resident={plan.resident} but the state was initialized in {where}'
        ' memory; AllDevice and streamed policies need separate init calls.'
    )


def _updates_from_rows(out: jax.Array, layout: layout_lib.Layout, params) -> PyTree:
  """Optax updates from the new parameter rows (master case) or the raw update rows."""
  leaves = layout_lib.unpack(out, layout)
  if not layout.needs_master:
    return layout.treedef.unflatten(leaves)
  state_dtype = jnp.dtype(layout.state_dtype)
  param_leaves = layout.treedef.flatten_up_to(params)
  # new_lowp - p in the state dtype: optax.apply_updates then adds in that dtype and
  # casts, which reproduces new_lowp exactly (JAX_NOTES: a 16-bit update would not).
  new = [
      leaf.astype(dtype).astype(state_dtype) - p.astype(state_dtype)
      for leaf, dtype, p in zip(leaves, layout.dtypes, param_leaves)
  ]
  return layout.treedef.unflatten(new)


def _constrain_like(updates: PyTree, layout: layout_lib.Layout, shardings) -> PyTree:
  leaves = layout.treedef.flatten_up_to(updates)
  constrained = [
      leaf if s is None else jax.lax.with_sharding_constraint(leaf, s)
      for leaf, s in zip(leaves, shardings)
  ]
  return layout.treedef.unflatten(constrained)
