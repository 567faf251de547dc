"""The step proper: one update of a state already in its plan's partition.

`run_step` builds what the state's partition says, and nothing else decides it: the
one-memory program's single call, or the two-memory program's one construction (the
early host calls in backward order, the last host call grouped with the device tiers'
stream lanes: docs/design.md, "One construction"). `transform.update_fn` checks the
inputs and calls it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import capability as capability_lib
from dos_jax import compiler_options
from dos_jax import lowering as lowering_lib
from dos_jax import memory_spaces
from dos_jax import meshes
from dos_jax import validate as validate_lib
from dos_jax.capability import Kernel
from dos_jax.geometry import layout as layout_lib
from dos_jax.kernels import pallas_adamw
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import Tier
from dos_jax.geometry.partition import TIERS
from dos_jax.geometry.state import OffloadedState
from dos_jax.geometry.state import ShardedOver
from dos_jax.implementation import Program
from dos_jax.step import construction
from dos_jax.step import disk_tier
from dos_jax.step import early_calls
from dos_jax.step import kernel_calls
from dos_jax.step import host_work as host_work_lib
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.step import lanes as lanes_lib
from dos_jax.step import paths
from dos_jax.step import stages
from dos_jax.step import state_init
from dos_jax.step import tier_updates
from dos_jax.step.options import StepOptions


@dataclasses.dataclass(frozen=True)
class StepKernels:
  """What one transform's steps share: its row update, AdamW's hyperparameters for the
  kernels (None: not AdamW, XLA's ops only) and the step options."""

  row_update: Callable[..., Any]
  adamw: AdamWHyperparams | None
  options: StepOptions


def _common_dtype(leaves, fallback) -> jnp.dtype:
  dtypes = {jnp.result_type(x) for x in leaves}
  return jnp.dtype(dtypes.pop()) if len(dtypes) == 1 else jnp.dtype(fallback)


def run_step(kernels: StepKernels, grad_leaves, param_leaves, state: OffloadedState,
             grad_scale, sharded, where: state_init.Placement):
  """`(new param or update leaves, new state)`: the step on checked leaves. `sharded` is
  the state's, or, inside `auto_axes`, its Explicit-axes view (made Auto here)."""
  options = kernels.options
  if sharded is not None and meshes.is_explicit(sharded.mesh):
    # Inside `auto_axes`: the context mesh has the same axes, as Auto axes; the
    # outputs' shardings are `auto_axes`'s to set.
    sharded = ShardedOver(jax.sharding.get_abstract_mesh(),
                          (None,) * len(sharded.param_shardings))
    where = state_init.placement(sharded.mesh, options.data_axis)
  mesh = construction.step_mesh(sharded)  # a one-device mesh: built as unsharded
  context, base_step, built = _context(kernels, grad_leaves, param_leaves, state,
                                       grad_scale, mesh)
  if built.two_streams and jax.default_backend() == 'gpu':
    compiler_options.warn_where_serial(jax.__version__, lowering_lib.checked())
  disk = _DiskUpdate(context, base_step, state.disk_gen) if state.partition.disk else None
  if built.two_streams and not built.sharded:
    # The one construction (`lanes`), given the host tier's work: its early host calls
    # traced here, the regions after them by the construction; the disk tier's calls last.
    host_tier = state.tier(Tier.HOST)
    work = early_calls.host_work(context, base_step, host_tier, state.partition.early,
                                 built.host_columns) if built.per_block else \
        host_work_lib.of_tier(context, base_step, host_tier, built.host_native)
    if disk is not None:
      work = _then_disk(work, disk, built)
    if built.lowering is lowering_lib.Lowering.STAGED:
      lanes = lanes_lib.stream_lanes(context.plan, context.part, count=built.lanes)
      new_tiers, outs = stages.update(context, base_step, state.tiers, work, lanes,
                                      native=built.device_native, pallas=built.pallas)
    else:
      new_tiers, outs = lanes_lib.update_on_two_streams(context, base_step, state.tiers,
                                                        built, work)
  else:
    new_tiers, outs = _update_tiers(context, base_step, state, built, disk)
  disk_gen = None
  if disk is not None:
    if disk.gen is None:  # not run inside the construction
      disk()
    disk_gen, outs = disk.gen, list(outs) + disk.outs
  layout = state.layout
  scalars = tuple(jax.device_put(x, memory_spaces.DEVICE) for x in context.new_scalars)
  new_leaves = _updates_from_leaves(
      partition_lib.leaves_from_blocks(outs, layout), layout, param_leaves,
      validate_lib.update_dtypes(layout, grad_leaves))
  if sharded is not None:
    # Inside jit a device_put to the same memory kind is a no-op that sharding
    # propagation may override; a constraint pins the ZeRO-1 layout.
    new_tiers, scalars = state_init.place(new_tiers, scalars, where, constrain=True)
    new_leaves = _constrain_like(new_leaves, sharded.param_shardings,
                                 param_leaves if param_leaves is not None else grad_leaves)
  return new_leaves, OffloadedState(
      host=new_tiers[Tier.HOST], streamed=new_tiers[Tier.STREAMED],
      resident=new_tiers[Tier.RESIDENT], scalars=scalars, layout=layout,
      slots=state.slots, partition=state.partition, sharded=state.sharded, disk_gen=disk_gen)


def _context(kernels: StepKernels, grad_leaves, param_leaves, state, grad_scale, mesh):
  """`(StepContext, base RowStep, Construction)`: what every tier's update shares, with
  the host-bound gradients sent to host memory where no early host call takes them, and
  how the step is built (`construction.resolve`: decided here, once)."""
  options, layout, part = kernels.options, state.layout, state.partition
  program = Program.TWO_MEMORIES if part.two_memories else Program.ONE_MEMORY
  grad_dtype = _common_dtype(grad_leaves, layout.state_dtype)
  # Shard-major (ZeRO-3): the leaves as each device's own shards (see `layout`).
  views = functools.partial(layout_lib.shard_views, layout=layout, mesh=mesh,
                            axis=options.data_axis)
  grad_leaves = views(grad_leaves)
  state_dtype = jnp.dtype(layout.state_dtype)
  base_step = paths.RowStep(
      row_update=kernels.row_update, slots=state.slots, has_master=layout.needs_master,
      decayed_rows=layout.decayed_rows, state_dtype=state_dtype,
      out_dtype=layout.lowp_dtype if layout.needs_master else state_dtype,
      grad_scale=grad_scale)
  native = capability_lib.capability(
      Kernel.NATIVE_HOST, kernels.adamw, base_step, program, grad_leaves).usable
  host_grad_pieces = {}
  built = construction.resolve(part, layout, mesh, options, native,
                               clipped=grad_scale is not None)
  if part.two_memories and not built.per_block and not (built.two_streams and built.sharded):
    # A sharded state's native host path takes its gradients as rows split over the
    # data axis (see `tier_updates.host_rows`).
    rows = None
    if built.host_native and mesh is not None:
      rows = (grad_dtype, NamedSharding(mesh, P(None, options.data_axis)))
    host_grad_pieces, grad_leaves = tier_updates.gate_device_update(
        layout, part, grad_leaves, rows=rows)
  # The scalar state's update (step counts) and the kernels' AdamW scalars: once per
  # step, apart from both paths.
  scalar_update = paths.scalar_update(base_step, state.scalars)
  adam_scalars = None if kernels.adamw is None else kernel_calls.step_scalars(
      kernels.adamw, base_step, scalar_update)
  context = tier_updates.StepContext(
      layout=layout, part=part, plan=part.plan, options=options, program=program,
      adamw=kernels.adamw, grad_leaves=grad_leaves,
      param_leaves=None if layout.needs_master or param_leaves is None else views(param_leaves),
      grad_dtype=grad_dtype, scalars=state.scalars, new_scalars=scalar_update[2],
      adam_scalars=adam_scalars, coefficients=_coefficients(kernels.adamw, adam_scalars),
      mesh=mesh, host_grad_pieces=host_grad_pieces)
  return context, base_step, built


def _coefficients(adamw, adam_scalars):
  """The Pallas kernel's packed AdamW coefficients of the step, once, behind an
  optimization barrier: every device row reads the same opaque values wherever its
  kernel runs (a stream region, a loop, XLA:CPU's interpreter fusing it), so the
  constructions agree bit for bit. None: not AdamW."""
  if adam_scalars is None:
    return None
  return jax.lax.optimization_barrier(
      pallas_adamw.packed_scalars(adam_scalars, nesterov=adamw.nesterov))


class _DiskUpdate:
  """The disk tier's update (`disk_tier.update`), run once where the step puts it: its
  new generation and `(out rows, pieces)` once called."""

  def __init__(self, context, base_step: paths.RowStep, gen, index=None):
    self.gen_in, self._args, self._index = gen, (context, base_step), index
    self.gen, self.outs = None, []

  def __call__(self) -> None:
    self.gen, self.outs = disk_tier.update(*self._args, self.gen_in, index=self._index)

  def calls(self, count: int, linked: bool) -> list[host_work_lib.HostItem]:
    """The update as `count` host items, each on a consecutive run of the disk
    subgroups, each after the call before it where `linked` (the staged lowering's
    host calls are chained; else the disk call waits for no earlier call); the next
    generation is the last call's (every call's is the same)."""
    runs = np.array_split(np.asarray(self._args[0].part.disk), max(1, count))
    self.outs = []
    return [host_work_lib.HostItem(
        region=functools.partial(self._region, tuple(int(i) for i in ids), linked),
        record=self._record) for ids in runs if len(ids)]

  def _region(self, subgroups: tuple[int, ...], linked: bool, link):
    return disk_tier.update(*self._args, self.gen_in, index=self._index, subgroups=subgroups,
                            link=link if linked else None)

  def _record(self, result):
    self.gen, outs = result
    self.outs.extend(outs)
    return outs[0][0]  # the token the next call's link is made from


class _ShardedDisk:
  """The disk tier inside the sharded construction (`lanes.sharded_two_streams`): on
  each device, its disk call in its own `shard_map` body, run after that device's
  other host work; the new generation comes back through `done`, the out rows with the
  construction's."""

  def __init__(self, outer: _DiskUpdate, native: bool, axis: str,
               built: construction.Construction):
    self.outer, self.native, self.axis, self.built = outer, native, axis, built
    self.gen = outer.gen_in

  def compose(self, local, step, host_work, host_tier, gen, axis_names):
    """`(the device's host work with its disk call last, the disk update)` for a
    device's local context; `host_work` the early calls' (or None)."""
    disk = _DiskUpdate(local, step, gen, disk_tier.file_index(local.part, self.axis,
                                                              axis_names))
    work = host_work if host_work is not None else host_work_lib.of_tier(
        local, step, host_tier, self.native)
    return _then_disk(work, disk, self.built), disk

  def done(self, new_gen) -> None:
    self.outer.gen, self.outer.outs = new_gen, []


def _then_disk(work: host_work_lib.HostWork, disk: _DiskUpdate,
               built: construction.Construction) -> host_work_lib.HostWork:
  """`work` with the disk update after it in `built.disk_calls` host calls: the longest
  host work, what the device tiers' lanes run beside."""
  staged = built.lowering is lowering_lib.Lowering.STAGED
  return work.then(*disk.calls(built.disk_calls, linked=staged))


def _update_tiers(context, base_step, state: OffloadedState,
                  built: construction.Construction, disk: _DiskUpdate | None = None):
  """`(new tiers, out rows per block)`: the sharded construction, or tier after tier where
  the construction does not apply (the one-memory program; see
  `construction.on_two_streams`), as `built` says. The sharded construction runs `disk`
  (the disk tier's call) as the host call its device tiers run beside; tier after tier,
  the caller runs it after the others."""
  part, options = context.part, context.options
  host_tier = state.tier(Tier.HOST)
  if built.two_streams:
    sharded_host = sharded_disk = None
    if built.per_block:  # each device's host calls by block (early ones, stages), in shard_map
      sharded_host = lambda local, step, host: early_calls.host_work(
          local, step, host, part.early, built.host_columns)
    if disk is not None:  # each device's disk call, after its other host work
      sharded_disk = _ShardedDisk(disk, built.host_native, options.data_axis, built)
    return lanes_lib.update_on_two_streams(context, base_step, state.tiers, built,
                                           sharded_host=sharded_host,
                                           sharded_disk=sharded_disk)
  new_tiers, outs = dict(state.tiers), []
  if built.early:
    new_tiers[Tier.HOST], outs = early_calls.update_host(context, base_step, host_tier,
                                                          part.early)
  for tier in TIERS:
    if not part.ids(tier) or (built.early and tier is Tier.HOST):
      continue
    if tier is not Tier.HOST:
      context = context.gate()  # the device update waits for the host call's inputs
    new_tiers[tier], tier_outs = context.update_tier(
        tier, base_step, state.tier(tier),
        native=built.host_native if tier is Tier.HOST else built.device_native)
    outs.extend(tier_outs)
  return new_tiers, outs


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


def _shard_alike(leaf, other):
  """`leaf` sharded as `other` (`jax.experimental.shard_alike`, which jax 0.11 removed:
  there `leaf` as it is, and XLA's sharding propagation decides)."""
  try:
    from jax.experimental.shard_alike import shard_alike  # pylint: disable=import-outside-toplevel
  except ImportError:
    return leaf
  return shard_alike(leaf, other)[0]


def _constrain_like(leaves: list[jax.Array], shardings, like: list[jax.Array]
                    ) -> list[jax.Array]:
  """`leaves` in the params' `shardings`; where one is not known (a state built under
  jit, from tracers), sharded as the leaf of `like` (the params, else the gradients)."""
  def pin(leaf, s, other):
    if s is None:
      return _shard_alike(leaf, other) if leaf.shape == other.shape else leaf
    if isinstance(s, NamedSharding) and meshes.is_explicit(s.mesh):
      return jax.device_put(leaf, s)
    return jax.lax.with_sharding_constraint(leaf, s)

  return [pin(leaf, s, other) for leaf, s, other in zip(leaves, shardings, like)]
