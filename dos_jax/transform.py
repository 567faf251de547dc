"""The offloaded optax transforms: `chain` and `adamw`.

`offloaded(inner, offload)` turns an element-wise optax transform into one whose state
is packed into `(G, S)` subgroups in host memory (see `layout`), and whose update runs
each subgroup on the host or on the device according to a `Plan` (see `paths`). The
wrapped transform's own `update` is what runs on each subgroup row, so the math is
optax's, op for op.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import clipping
from dos_jax import fused as fused_lib
from dos_jax import layout as layout_lib
from dos_jax import partition as partition_lib
from dos_jax import paths
from dos_jax import slots as slots_lib
from dos_jax.partition import Tier
from dos_jax.partition import TIERS
from dos_jax.kernels import host_adamw_rows
from dos_jax.offload import Offload
from dos_jax.offload import Platform
from dos_jax.offload import UpdateImpl
from dos_jax.policies import Plan

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadedState:
  """State of an offloaded transform.

  The per-element state is stored in tiers (see `partition`): each tier holds one
  `(R, K, S)` array per dtype (see `slots`) for its R subgroups, in ascending subgroup
  order: the fp32 master (kept only for lower-precision params) and the wrapped
  transforms' moments. A tier with no subgroup holds `(0, K, S)` arrays.

  Attributes:
    host: the host-updated subgroups' state, in `pinned_host` memory.
    streamed: the device-streamed subgroups' state, in `pinned_host` memory.
    resident: the state kept in device memory (`AllDevice`).
    scalars: the wrapped transforms' scalar state (step counts), shared by every
      subgroup since all subgroups take every step together; in device memory.
    layout: how parameters map onto subgroups (static metadata).
    slots: where each state leaf is stored (static metadata).
    partition: which subgroups each tier holds (static metadata).
  """

  host: tuple[jax.Array, ...]
  streamed: tuple[jax.Array, ...]
  resident: tuple[jax.Array, ...]
  scalars: tuple[jax.Array, ...]
  layout: layout_lib.Layout = dataclasses.field(metadata=dict(static=True))
  slots: slots_lib.Slots = dataclasses.field(metadata=dict(static=True))
  partition: partition_lib.Partition = dataclasses.field(metadata=dict(static=True))

  def tier(self, tier: Tier) -> tuple[jax.Array, ...]:
    return getattr(self, tier.value)

  @property
  def tiers(self) -> dict[Tier, tuple[jax.Array, ...]]:
    return {tier: self.tier(tier) for tier in TIERS}

  def rows(self) -> tuple[jax.Array, ...]:
    """The whole per-element state, one `(G, K, S)` array per dtype in subgroup order.
    A copy in device memory: for inspection and checkpoints, not for the training step."""
    moved = {t: tuple(_to_device_memory(x) for x in arrays) for t, arrays in self.tiers.items()}
    return partition_lib.merge_tiers(moved, self.partition)

  def unstacked(self) -> tuple[jax.Array | None, Any]:
    """`(master, inner_state)` as the wrapped transforms define it, with `(G, S)`
    leaves; a copy in device memory (see `rows`)."""
    return slots_lib.join(self.rows(), self.scalars, self.slots, axis=1)

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
  """Where state leaves go: per-element rows of each tier and the scalars."""

  rows: dict[Tier, Any]
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


def _memory_kind(tier: Tier) -> str:
  return 'device' if tier is Tier.RESIDENT else 'pinned_host'


def _placement(mesh, offload: Offload) -> _Placement:
  if mesh is None:
    return _Placement(
        rows={t: paths.DEVICE if t is Tier.RESIDENT else paths.HOST for t in TIERS},
        scalars=paths.DEVICE)
  return _Placement(
      rows={t: NamedSharding(mesh, P(None, None, offload.data_axis),
                             memory_kind=_memory_kind(t)) for t in TIERS},
      scalars=NamedSharding(mesh, P(), memory_kind='device'),
  )


def _place(tiers: dict[Tier, tuple], scalars, placement: _Placement, constrain: bool = False):
  def put(x, target):
    if constrain and isinstance(target, NamedSharding):
      return jax.lax.with_sharding_constraint(x, target)
    return jax.device_put(x, target)

  tiers = {t: tuple(put(x, placement.rows[t]) for x in arrays) for t, arrays in tiers.items()}
  return tiers, tuple(put(x, placement.scalars) for x in scalars)


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
    override the policy's plan for this step, and `grad_scale=` (a scalar, e.g. a
    global-norm clip factor) that multiplies every gradient, in fp32, on whichever path
    updates it.
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
    split = offload.target() is Platform.GPU
    part = partition_lib.for_plan(offload.policy.plan(layout.spec()), split)
    placement = _placement(mesh, offload)
    size, state_dtype = layout.subgroup_size, jnp.dtype(layout.state_dtype)

    def row_state(master):
      # Element-wise transforms initialize every element alike (zeros, a constant), so
      # one row's state broadcast over the rows is the whole state, built where the
      # master is (optax's zeros_like would create it in device memory).
      return inner.init(master[0])

    def full_state(params):
      master = layout_lib.pack(params, layout, state_dtype)
      state = jax.tree.map(
          lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(x, master.shape),
          row_state(master))
      return master if layout.needs_master else None, state

    template = jax.eval_shape(full_state, params)
    slots = slots_lib.build(template, row_ndim=2)

    def tier_state(leaves, tier: Tier, space):
      """One tier's stacked arrays and the scalars, built in `space` from its pieces."""
      runs = partition_lib.pieces(layout, part, tier)
      num_rows = len(part.ids(tier))
      master = partition_lib.assemble(
          partition_lib.slice_pieces(leaves, runs), runs, num_rows, size, state_dtype)
      state = jax.tree.map(
          lambda x: x if jnp.ndim(x) == 0 else jnp.broadcast_to(
              jax.device_put(x, space), master.shape), row_state(master))
      return slots_lib.split((master if layout.needs_master else None, state), slots, axis=1)

    def empty_tier():
      shapes = jax.eval_shape(lambda t: slots_lib.split(t, slots, axis=1)[0], template)
      return tuple(jnp.zeros((0,) + x.shape[1:], x.dtype) for x in shapes)

    def build(params):
      # The state is created where it lives: host tiers from the params copied to host
      # memory and packed there, so the device never holds 12 bytes per parameter, not
      # even during init.
      leaves = layout.treedef.flatten_up_to(params)
      tiers, scalars = {}, None
      for tier in TIERS:
        if not part.ids(tier):
          tiers[tier] = empty_tier()
        elif tier is Tier.RESIDENT:
          tiers[tier], scalars = tier_state(leaves, tier, paths.DEVICE)
        else:
          # 0-d leaves would drop their memory space (JAX exempts scalars); packing
          # ravels every leaf anyway.
          host_leaves = paths.to_host([jnp.atleast_1d(x) for x in leaves])
          fn = functools.partial(tier_state, tier=tier, space=paths.HOST)
          fn = paths.host_region(fn) if split else fn
          tiers[tier], scalars = fn(host_leaves)
      return _place(tiers, scalars, placement)

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
    tiers, scalars = build(params) if traced else jax.jit(build)(params)
    return OffloadedState(
        host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
        scalars=scalars, layout=layout, slots=slots, partition=part)

  def update_fn(updates, state: OffloadedState, params=None, *, plan: Plan | None = None,
                grad_scale: jax.Array | float | None = None, **extra_args):
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
    split = offload.target() is Platform.GPU
    mesh_info = shardings_by_layout.get(layout)
    placement = _placement(None if mesh_info is None else mesh_info[0], offload)
    wanted = partition_lib.for_plan(plan, split)
    if wanted != state.partition:
      state = _migrate(state, wanted, placement, split)
    part = state.partition
    grad_leaves = layout.treedef.flatten_up_to(updates)
    param_leaves = None if params is None else layout.treedef.flatten_up_to(params)
    grad_dtype = _common_dtype(grad_leaves, layout.state_dtype)
    state_dtype = jnp.dtype(layout.state_dtype)
    out_dtype = layout.lowp_dtype if layout.needs_master else state_dtype
    base_step = paths.RowStep(
        row_update=row_update, slots=state.slots, has_master=layout.needs_master,
        decayed_rows=layout.decayed_rows, state_dtype=state_dtype, out_dtype=out_dtype,
        grad_scale=None if grad_scale is None else jnp.asarray(grad_scale, state_dtype))
    # The native host call in a host region has no sharding rule: the accelerator
    # program's sharded state stays on XLA's host loop.
    native = fused_lib.usable(fused, base_step, state.host, grad_leaves) and not (
        split and mesh_info is not None)
    if native and split:
      # On a GPU the host regions run in the CUDA plugin's own XLA: the native kernel
      # must be registered there too, else (one warning) XLA's host loop runs instead.
      native = host_adamw_rows.host_kernel_in_gpu_programs()[0]
    context = _StepContext(
        layout=layout, part=part, plan=plan, offload=offload, fused=fused, split=split,
        grad_leaves=grad_leaves, param_leaves=None if layout.needs_master else param_leaves,
        grad_dtype=grad_dtype, scalars=state.scalars,
        mesh=None if mesh_info is None else mesh_info[0])
    new_tiers, outs = dict(state.tiers), {}
    for tier in TIERS:
      if not part.ids(tier):
        continue
      step = dataclasses.replace(
          base_step, decayed_rows=part.decayed_rows(tier, layout.decayed_rows))
      impl = offload.host_impl if tier is Tier.HOST else offload.device_impl
      new_tiers[tier], outs[tier] = context.update_tier(
          tier, step, state.tier(tier), native=native and impl is UpdateImpl.KERNEL)
    # Computed once from the pre-step scalars, apart from both paths.
    scalars = tuple(jax.device_put(x, paths.DEVICE)
                    for x in paths.next_scalars(base_step, state.scalars))
    new_updates = _updates_from_leaves(
        partition_lib.leaves_from_rows(outs, layout, part), layout, params)
    if mesh_info is not None:
      # Inside jit a device_put to the same memory kind is a no-op that sharding
      # propagation may override; a constraint pins the ZeRO-1 layout.
      new_tiers, scalars = _place(new_tiers, scalars, placement, constrain=True)
      new_updates = _constrain_like(new_updates, layout, mesh_info[1])
    return new_updates, OffloadedState(
        host=new_tiers[Tier.HOST], streamed=new_tiers[Tier.STREAMED],
        resident=new_tiers[Tier.RESIDENT], scalars=scalars, layout=layout,
        slots=state.slots, partition=part)

  return clipping.mark_offloaded(optax.GradientTransformationExtraArgs(init_fn, update_fn))


@dataclasses.dataclass(frozen=True, eq=False)
class _StepContext:
  """What every tier's update in one step shares."""

  layout: layout_lib.Layout
  part: partition_lib.Partition
  plan: Plan
  offload: Offload
  fused: fused_lib.FusedAdamW | None
  split: bool
  grad_leaves: list[Any]
  param_leaves: list[Any] | None  # only for fp32 params (no master)
  grad_dtype: Any
  scalars: tuple[jax.Array, ...]
  mesh: Any  # the mesh the state is sharded over (ZeRO-1), or None

  def update_tier(self, tier: Tier, step: paths.RowStep, arrays, native: bool):
    """Updates one tier; returns (new arrays, out rows on the device)."""
    runs = partition_lib.pieces(self.layout, self.part, tier)
    if tier is Tier.HOST:
      return self._host(step, arrays, runs, native)
    if not self.split and native:
      return self._one_memory_native(step, arrays, resident=True)
    num_rows, size = arrays[0].shape[0], self.layout.subgroup_size
    grads = partition_lib.assemble(partition_lib.slice_pieces(self.grad_leaves, runs), runs,
                                   num_rows, size, self.grad_dtype)
    params = None
    if self.param_leaves is not None:
      params = partition_lib.assemble(partition_lib.slice_pieces(self.param_leaves, runs),
                                      runs, num_rows, size, step.state_dtype)
    device_step = step
    if fused_lib.device_usable(self.fused, self.offload, step, arrays):
      device_step = fused_lib.device_step(self.fused, step, self.scalars)
    ids = self.part.ids(tier)
    order = tuple(range(num_rows))
    if tier is Tier.STREAMED:
      order = self.part.local(tier, [g for g in self.plan.device if g in set(ids)])
    out = jnp.zeros((num_rows, size), step.out_dtype)
    return paths.row_loop(order, device_step, stacked=arrays, scalars=self.scalars,
                          grads=grads, params=params, out=out, buffers=self.plan.buffers,
                          stream=tier is Tier.STREAMED)

  def _one_memory_native(self, step, arrays, resident: bool):
    if self.mesh is not None:
      num_rows, size = arrays[0].shape[0], self.layout.subgroup_size
      runs = partition_lib.pieces(self.layout, self.part, self.part.tier_of(0))
      rows_sharding = NamedSharding(self.mesh, P(None, self.offload.data_axis))

      def packed(leaves, dtype):
        rows = partition_lib.assemble(partition_lib.slice_pieces(leaves, runs), runs,
                                      num_rows, size, dtype)
        return jax.lax.with_sharding_constraint(rows, rows_sharding)

      params = None
      if self.param_leaves is not None:
        params = packed(self.param_leaves, step.state_dtype)
      return fused_lib.sharded_update(
          step, self.fused, stacked=arrays, scalars=self.scalars,
          grads=packed(self.grad_leaves, self.grad_dtype), params=params, mesh=self.mesh,
          data_axis=self.offload.data_axis, resident=resident,
          num_threads=self.offload.host_threads)
    leaves = fused_lib.Leaves(grads=self.grad_leaves, offsets=self.layout.offsets,
                              params=self.param_leaves)
    return fused_lib.host_update(step, self.fused, stacked=arrays, scalars=self.scalars,
                                 leaves=leaves, resident=resident,
                                 num_threads=self.offload.host_threads)

  def _host(self, step, arrays, runs, native: bool):
    if not self.split and native:
      return self._one_memory_native(step, arrays, resident=False)
    if not self.split:
      # One memory: the rows are packed where the gradients are and handed over whole.
      num_rows, size = arrays[0].shape[0], self.layout.subgroup_size
      whole = (partition_lib.Piece(leaf=0, start=0, size=num_rows * size, offset=0),)

      def packed(leaves, dtype):
        rows = partition_lib.assemble(partition_lib.slice_pieces(leaves, runs), runs,
                                      num_rows, size, dtype)
        return [paths.to_host(rows.reshape(-1))]

      grad_pieces = packed(self.grad_leaves, self.grad_dtype)
      param_pieces = None
      if self.param_leaves is not None:
        param_pieces = packed(self.param_leaves, step.state_dtype)
      arrays, out_h = paths.host_region_update(
          step, stacked=arrays, scalars=self.scalars, grad_pieces=grad_pieces,
          param_pieces=param_pieces, runs=whole, grad_dtype=self.grad_dtype, region=False)
      return arrays, jax.device_put(out_h, paths.DEVICE)
    # Each piece of a host-bound gradient leaves the device on its own, as soon as the
    # backward pass has produced its leaf: never after a concatenation of all gradients.
    grad_pieces = paths.to_host(partition_lib.slice_pieces(self.grad_leaves, runs))
    param_pieces = None
    if self.param_leaves is not None:
      param_pieces = paths.to_host(partition_lib.slice_pieces(self.param_leaves, runs))
    if native and self.split:
      arrays, out_h = fused_lib.host_region_update(
          step, self.fused, stacked=arrays, scalars=self.scalars, grad_pieces=grad_pieces,
          param_pieces=param_pieces, runs=runs, num_threads=self.offload.host_threads)
    else:
      arrays, out_h = paths.host_region_update(
          step, stacked=arrays, scalars=self.scalars, grad_pieces=grad_pieces,
          param_pieces=param_pieces, runs=runs, grad_dtype=self.grad_dtype,
          region=self.split)
    return paths.put(arrays, paths.HOST), jax.device_put(out_h, paths.DEVICE)


def _migrate(state: OffloadedState, wanted: partition_lib.Partition, placement: _Placement,
             split: bool) -> OffloadedState:
  """Moves rows between tiers for a plan whose partition differs from the state's.

  Rare (a new plan from `Auto`, or `plan=` naming another split): it merges the tiers
  in host memory and splits them again, so it briefly holds a second copy of the state
  in host memory, never in device memory beyond the resident tier itself.
  """
  host_tiers = {t: paths.to_host(arrays) for t, arrays in state.tiers.items()}

  def move(host_tiers):
    return partition_lib.split_tiers(partition_lib.merge_tiers(host_tiers, state.partition), wanted)

  tiers = (paths.host_region(move) if split else move)(host_tiers)
  tiers = {t: paths.put(arrays, paths.DEVICE if t is Tier.RESIDENT else paths.HOST)
           for t, arrays in tiers.items()}
  del placement  # the step's output constraints place the tiers on the mesh
  return OffloadedState(
      host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
      scalars=state.scalars, layout=state.layout, slots=state.slots, partition=wanted)


def _check_plan(plan: Plan, state: OffloadedState) -> None:
  if not isinstance(plan, Plan):
    raise TypeError(f'dos_jax: plan must be a dos_jax.Plan, got {type(plan).__name__}')
  if plan.num_subgroups != state.layout.num_subgroups:
    raise ValueError(
        f'dos_jax: the plan covers {plan.num_subgroups} subgroups but the state has'
        f' {state.layout.num_subgroups}'
    )


def _updates_from_leaves(leaves: list[jax.Array], layout: layout_lib.Layout,
                         params) -> PyTree:
  """Optax updates from the new parameter leaves (master case) or the raw updates."""
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
