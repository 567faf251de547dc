"""The offloaded optax transforms: `chain` and `adamw`.

`offloaded(inner, offload)` turns an element-wise optax transform into one whose state
is packed into `(G, S)` subgroups in host memory (see `layout`), and whose update runs
each subgroup on the host or on the device according to a `Plan` (see `paths`). The
wrapped transform's own `update` is what runs on each subgroup row, so the math is
optax's, op for op.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import capability as capability_lib
from dos_jax.step import chunked as chunked_lib
from dos_jax.step import construction
from dos_jax import clipping
from dos_jax.step import early_chunks
from dos_jax.step import fused as fused_lib
from dos_jax.step import lanes as lanes_lib
from dos_jax.geometry import layout as layout_lib
from dos_jax import meshes
from dos_jax import offload as offload_lib
from dos_jax import migration as migration_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.step import paths
from dos_jax.geometry import slots as slots_lib
from dos_jax.step import tier_updates
from dos_jax import validate as validate_lib
from dos_jax.capability import Kernel
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.partition import TIERS
from dos_jax.offload import Offload
from dos_jax.offload import Program
from dos_jax.offload import UpdateImpl
from dos_jax.policies import Plan
from dos_jax.geometry.state import OffloadedState
from dos_jax.geometry.state import ShardedOver

PyTree = Any


class _Placement(NamedTuple):
  """Where state leaves go: per-element rows of each tier and the scalars."""

  rows: dict[Tier, Any]
  scalars: Any


def _placement(mesh, offload: Offload) -> _Placement:
  if mesh is None:
    return _Placement(
        rows={t: paths.DEVICE if t is Tier.RESIDENT else paths.HOST for t in TIERS},
        scalars=paths.DEVICE)
  return _Placement(
      rows={t: NamedSharding(mesh, P(None, None, offload.data_axis),
                             memory_kind=t.memory_kind) for t in TIERS},
      scalars=NamedSharding(mesh, P(), memory_kind='device'),
  )


def _place(tiers: dict[Tier, tuple], scalars, placement: _Placement, constrain: bool = False):
  def put(x, target):
    # With Explicit mesh axes the sharding is part of the type: device_put reshards.
    if constrain and isinstance(target, NamedSharding) and not meshes.is_explicit(target.mesh):
      # device_put moves the memory; only a constraint makes sharding propagation keep
      # the spec (a device_put to an abstract mesh or of a constant may lose it).
      return jax.lax.with_sharding_constraint(jax.device_put(x, target), target)
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
    shard_dims: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs an element-wise optax transform on host-resident subgroups.

  Args:
    inner: an element-wise transform; its update is applied to each subgroup row with
      the extra keyword `row_decayed` (whether the row holds weight-decayed leaves).
    offload: subgroup size, placement policy, mesh; `None` means `Offload()`.
    mask: weight-decay mask (pytree or callable) used to group decayed leaves.
    validate: called with the params at `init`, to reject unsupported transforms early.
    fused: set when `inner` is AdamW's chain (see `fused.FusedAdamW`): the host path
      may then run as one native call (`offload.host_impl`, see `capability`).
    shard_dims: ZeRO-3, params split over `offload.data_axis`: per leaf (a pytree or a
      callable of the params) the dimension split over it, or None. Given, the state
      is packed shard-major on a mesh (see `layout`): each device packs and unpacks its
      own shards of the leaves, and no row is gathered.

  Returns:
    A transform whose update also accepts `plan=` (a `Plan`, static under jit) to
    override the policy's plan for this step, and `grad_scale=` (a scalar, e.g. a
    global-norm clip factor) that multiplies every gradient, in fp32, on whichever path
    updates it.
  """
  validate_lib.check_offload(offload, 'dos_jax.offloaded')
  offload = Offload() if offload is None else offload

  def row_update(grad, state, param, decayed):
    return inner.update(grad, state, param, row_decayed=decayed)

  def init_fn(params):
    if validate_lib.is_params_placeholder(params):
      # optax.tree_utils.tree_map_params: the packed state holds no params-shaped tree.
      return validate_lib.NOT_PARAMS_SHAPED
    validate_lib.check_params(params)
    validate_lib.warn_if_uncommitted(params)
    if validate is not None:
      validate(params)
    mesh = meshes.find_mesh(params, offload)
    shard_multiple = mesh.shape[offload.data_axis] if mesh is not None else 1
    layout = layout_lib.make_layout(
        params,
        offload.subgroup_size,
        decay_flags=layout_lib.resolve_mask(mask, params),
        shard_multiple=shard_multiple,
        shard_dims=layout_lib.resolve_shard_dims(shard_dims, params),
    )
    sharded = None if mesh is None else ShardedOver(mesh, tuple(
        meshes.leaf_sharding(leaf) for leaf in layout.treedef.flatten_up_to(params)))
    split = offload.target() is Program.TWO_MEMORIES
    part = partition_lib.for_plan(offload.policy.plan(layout.spec()), split,
                                  per_subgroup=offload.per_subgroup())
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

    # Shapes only: no sharding, which Explicit mesh axes would make part of the types.
    template = jax.eval_shape(full_state, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params))
    slots = slots_lib.build(template, row_ndim=2)

    def block_state(leaves, ids, space):
      """One block's stacked arrays (subgroups `ids`) and the scalars, built in `space`
      from its pieces."""
      runs = partition_lib.pieces_of(layout, ids)
      num_rows, shards = len(ids), layout.shards
      master = partition_lib.assemble(
          partition_lib.slice_pieces(layout_lib.shard_views(leaves, layout), runs, shards),
          runs, num_rows, size, state_dtype, shards)
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
      tiers, scalars, host_leaves = {}, None, None
      for tier in TIERS:
        if not part.ids(tier):
          tiers[tier] = () if part.per_subgroup else empty_tier()
          continue
        arrays = []
        for ids in part.blocks(tier):
          if tier is Tier.RESIDENT:
            block, scalars = block_state(leaves, ids, paths.DEVICE)
          else:
            if host_leaves is None:
              # 0-d leaves would drop their memory space (JAX exempts scalars); packing
              # ravels every leaf anyway.
              host_leaves = paths.to_host([jnp.atleast_1d(x) for x in leaves])
            fn = functools.partial(block_state, ids=ids, space=paths.HOST)
            fn = paths.host_region(fn) if split else fn
            block, scalars = fn(host_leaves)
          arrays.extend(block)
        tiers[tier] = tuple(arrays)
      if mesh is not None:
        # Keeps the params an input of the jitted init even where no state value reads
        # them (fp32 params keep no master): that jit takes its devices from them.
        probe = [jnp.ravel(x)[0] for x in leaves if x.size][:1]
        scalars = tuple(jnp.where(jnp.isnan(probe[0]), x, x) for x in scalars) if probe \
            else scalars
      return _place(tiers, scalars, placement, constrain=True)

    def run(params):
      explicit = meshes.explicit_mesh(jax.tree.leaves(params))
      if explicit is None:
        return build(params)
      rows = P(None, None, offload.data_axis) if offload.data_axis in explicit.shape else P()
      specs = ({t: (rows,) * (len(slots.groups) * len(part.blocks(t))) for t in TIERS},
               (P(),) * sum(1 for g, _ in slots.places if g < 0))
      with jax.sharding.use_abstract_mesh(explicit):  # see update_fn
        return jax.sharding.auto_axes(build, out_sharding=specs)(params)

    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
    tiers, scalars = run(params) if traced else jax.jit(run)(params)
    return OffloadedState(
        host=tiers[Tier.HOST], streamed=tiers[Tier.STREAMED], resident=tiers[Tier.RESIDENT],
        scalars=scalars, layout=layout, slots=slots, partition=part, sharded=sharded)

  def update_fn(updates, state: OffloadedState, params=None, *, plan: Plan | None = None,
                grad_scale: jax.Array | float | None = None, **extra_args):
    del extra_args
    if not isinstance(state, OffloadedState):
      raise TypeError(f'dos_jax: expected an OffloadedState, got {type(state).__name__}')
    layout = state.layout
    if plan is None:
      plan = offload.policy.plan(layout.spec())
    migration_lib.check_plan(plan, state)
    if params is None and layout.needs_master:
      raise ValueError(
          'dos_jax: params are required: updates are computed against the fp32 master.'
      )
    grad_leaves = validate_lib.leaves_like(updates, layout, 'updates')
    param_leaves = None if params is None else validate_lib.leaves_like(params, layout, 'params')
    # What the state was built for (mesh, params' shardings, program) comes with it: any
    # transform built alike steps it the same (a fresh one after a restart, or the one
    # `optax.inject_hyperparams` builds at every update).
    sharded = state.sharded
    placement = _placement(None if sharded is None else sharded.mesh, offload)
    if migration_lib.partition_for(plan, state) != state.partition:
      if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        raise ValueError(
            f'dos_jax: the state is laid out for another plan than this step\'s'
            f' ({plan.describe()}); move its rows first, between steps:'
            ' opt_state = dos_jax.migrate(opt_state, plan)')
      state = migration_lib.migrate_state(state, plan)
    if grad_scale is not None:
      grad_scale = jnp.asarray(grad_scale, layout.state_dtype)
    explicit = meshes.explicit_mesh(grad_leaves + (param_leaves or []))
    if explicit is None:
      new_leaves, new_state = step_body(grad_leaves, param_leaves, state, grad_scale,
                                        plan, sharded, placement)
    else:
      # Sharding in types: the packing concatenates leaves sharded unlike each other,
      # which Explicit axes refuse; inside `auto_axes` XLA chooses, as with Auto axes.
      def spec(leaf):
        return getattr(getattr(jax.typeof(leaf), 'sharding', None), 'spec', P())

      out_specs = ([spec(x) for x in (param_leaves or grad_leaves)],
                   meshes.state_specs(state, explicit, offload.data_axis))
      body = functools.partial(step_body, plan=plan, sharded=sharded, placement=placement)
      with jax.sharding.use_abstract_mesh(explicit):
        new_leaves, new_state = jax.sharding.auto_axes(body, out_sharding=out_specs)(
            grad_leaves, param_leaves, state, grad_scale)
    # The updates take the structure of the updates given (optax's convention), not
    # the init-time one: node types may differ (nnx.Param at init, arrays here).
    return jax.tree.structure(updates).unflatten(new_leaves), new_state

  def step_body(grad_leaves, param_leaves, state, grad_scale, plan, sharded, placement):
    """The step proper, on checked leaves and a state already in the plan's partition.
    `sharded` is the state's, or, inside `auto_axes`, its Auto-axes view."""
    if sharded is not None and meshes.is_explicit(sharded.mesh):
      # Inside `auto_axes`: the context mesh has the same axes, as Auto axes; the
      # outputs' shardings are `auto_axes`'s to set.
      sharded = ShardedOver(jax.sharding.get_abstract_mesh(),
                            (None,) * len(sharded.param_shardings))
      placement = _placement(sharded.mesh, offload)
    mesh = construction.step_mesh(sharded)  # a one-device mesh: built as unsharded
    layout, part = state.layout, state.partition
    # The program the state was built for (init chose it: `Offload.target`).
    program = Program.TWO_MEMORIES if part.split else Program.ONE_MEMORY
    split = program is Program.TWO_MEMORIES
    grad_dtype = _common_dtype(grad_leaves, layout.state_dtype)
    # Shard-major (ZeRO-3): the leaves as each device's own shards (see `layout`).
    views = functools.partial(layout_lib.shard_views, layout=layout, mesh=mesh,
                              axis=offload.data_axis)
    grad_leaves = views(grad_leaves)
    state_dtype = jnp.dtype(layout.state_dtype)
    out_dtype = layout.lowp_dtype if layout.needs_master else state_dtype
    base_step = paths.RowStep(
        row_update=row_update, slots=state.slots, has_master=layout.needs_master,
        decayed_rows=layout.decayed_rows, state_dtype=state_dtype, out_dtype=out_dtype,
        grad_scale=grad_scale)
    native = capability_lib.capability(
        Kernel.NATIVE_HOST, fused, base_step, program, grad_leaves).usable
    chunks, on_two_streams = construction.constructions(offload, part, layout, mesh, native)
    run_chunked = bool(chunks)
    early = offload.early_for(layout.spec(), plan) if split and part.per_subgroup else 0
    # Sharded, early chunks run inside that construction, on each device's columns.
    run_early = (split and offload_lib.early_calls(early) > 1 and native
                 and offload.host_impl is UpdateImpl.KERNEL and part.per_subgroup
                 and (mesh is None or on_two_streams) and len(part.blocks(Tier.HOST)) > 1)
    host_grad_pieces = {}
    if split and not run_chunked and not run_early and not (on_two_streams and mesh is not None):
      # A sharded state's native host path takes its gradients as rows split over the
      # data axis (see `tier_updates.host_rows`).
      rows = None
      if native and offload.host_impl is UpdateImpl.KERNEL and mesh is not None:
        rows = (grad_dtype, NamedSharding(mesh, P(None, offload.data_axis)))
      host_grad_pieces, grad_leaves = tier_updates.gate_device_update(
          layout, part, grad_leaves, rows=rows)
    # The scalar state's update (step counts) and the kernels' AdamW scalars: once per
    # step, apart from both paths.
    scalar_update = paths.scalar_update(base_step, state.scalars)
    context = tier_updates.StepContext(
        layout=layout, part=part, plan=plan, offload=offload, program=program, fused=fused,
        grad_leaves=grad_leaves,
        param_leaves=None if layout.needs_master or param_leaves is None else views(param_leaves),
        grad_dtype=grad_dtype, scalars=state.scalars, new_scalars=scalar_update[2],
        adam_scalars=None if fused is None else fused_lib.step_scalars(
            fused, base_step, scalar_update),
        mesh=mesh, host_grad_pieces=host_grad_pieces)
    new_tiers, outs = dict(state.tiers), []
    if run_chunked:
      chunked_tiers, outs = chunked_lib.update(
          context, base_step, {t: state.tier(t) for t in (Tier.HOST, Tier.STREAMED)},
          chunks)
      new_tiers.update(chunked_tiers)
    host_update = None
    if run_early and mesh is None:  # the host tier in early chunks (`step.early_chunks`)
      host_update = functools.partial(early_chunks.update_host, context, base_step,
                                      state.tier(Tier.HOST), early)
    if on_two_streams:
      sharded_host = None
      if run_early and mesh is not None:  # each device's early chunks, inside shard_map
        sharded_host = lambda local, step, host: functools.partial(
            early_chunks.update_host, local, step, host, early)
      new_tiers, outs = lanes_lib.update_on_two_streams(
          context, base_step, state.tiers, native, offload, host_update,
          sharded_host=sharded_host)
    else:
      if run_early:
        new_tiers[Tier.HOST], outs = host_update()
      for tier in TIERS:
        if not part.ids(tier) or (run_chunked and tier is not Tier.RESIDENT):
          continue
        if run_early and tier is Tier.HOST:
          continue
        impl = offload.host_impl if tier is Tier.HOST else offload.device_impl
        if tier is not Tier.HOST:
          context = context.gate()  # the device update waits for the host call's inputs
        new_tiers[tier], tier_outs = context.update_tier(
            tier, base_step, state.tier(tier), native=native and impl is UpdateImpl.KERNEL)
        outs.extend(tier_outs)
    scalars = tuple(jax.device_put(x, paths.DEVICE) for x in scalar_update[2])
    new_leaves = _updates_from_leaves(
        partition_lib.leaves_from_blocks(outs, layout), layout, param_leaves,
        validate_lib.update_dtypes(layout, grad_leaves))
    if sharded is not None:
      # Inside jit a device_put to the same memory kind is a no-op that sharding
      # propagation may override; a constraint pins the ZeRO-1 layout.
      new_tiers, scalars = _place(new_tiers, scalars, placement, constrain=True)
      new_leaves = _constrain_like(new_leaves, sharded.param_shardings)
    return new_leaves, OffloadedState(
        host=new_tiers[Tier.HOST], streamed=new_tiers[Tier.STREAMED],
        resident=new_tiers[Tier.RESIDENT], scalars=scalars, layout=layout,
        slots=state.slots, partition=part, sharded=state.sharded)

  return clipping.mark_offloaded(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _updates_from_leaves(leaves: list[jax.Array], layout: layout_lib.Layout,
                         param_leaves: list[jax.Array] | None,
                         dtypes: list[jnp.dtype]) -> list[jax.Array]:
  """Optax update leaves, in `dtypes` (see `validate.update_dtypes`), from the new
  parameter leaves (master case: `new_lowp - p` in the state dtype, which
  `optax.apply_updates` turns back into `new_lowp`; docs/design.md, JAX facts, says when
  exactly and by how much otherwise) or the raw updates."""
  if not layout.needs_master:
    return [leaf.astype(d) for leaf, d in zip(leaves, dtypes)]
  state_dtype = jnp.dtype(layout.state_dtype)
  return [
      (leaf.astype(dtype).astype(state_dtype) - p.astype(state_dtype)).astype(d)
      for leaf, dtype, p, d in zip(leaves, layout.dtypes, param_leaves, dtypes)
  ]


def _constrain_like(leaves: list[jax.Array], shardings) -> list[jax.Array]:
  def pin(leaf, s):
    if s is None:
      return leaf
    if isinstance(s, NamedSharding) and meshes.is_explicit(s.mesh):
      return jax.device_put(leaf, s)
    return jax.lax.with_sharding_constraint(leaf, s)

  return [pin(leaf, s) for leaf, s in zip(leaves, shardings)]
