"""How one step updates each tier of the state: the host tier in host memory (a host
region, or the native kernel), the streamed tier through the device, the resident tier
in place; block by block (see `partition`), with what every tier's update shares.

`transform` builds one `StepContext` per traced step and asks it for each tier's new
arrays and output rows; the paths themselves are in `paths` and `fused`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import fused as fused_lib
from dos_jax import layout as layout_lib
from dos_jax import partition as partition_lib
from dos_jax import paths
from dos_jax.offload import Offload
from dos_jax.partition import Tier
from dos_jax.policies import Plan


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
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
  # Accelerator program: each host block's gradient pieces, already sent to host memory
  # (see `gate_device_update`), by the block's subgroups.
  host_grad_pieces: dict[tuple[int, ...], list[Any]] = dataclasses.field(default_factory=dict)
  # Accelerator program: the host regions' inputs other than the state, appended as the
  # host tier is built (see `gate`).
  host_inputs: list[Any] = dataclasses.field(default_factory=list)

  def gate(self) -> 'StepContext':
    """This context with the device tiers' gradients let through an optimization barrier
    together with every input of the host regions built so far (gradient pieces,
    scalars, row indices, all in host memory).

    Then no device update can be issued before the host call's last input is ready, the
    moment the host call can start: the scheduler's use of the host call's latency is
    the device update (see `gate_device_update`, which gates on the gradient pieces
    alone and let small scalar copies slip behind the device loop in some programs).
    """
    if not self.split or not self.host_inputs:
      return self
    _, leaves = lax.optimization_barrier((self.host_inputs, list(self.grad_leaves)))
    return dataclasses.replace(self, grad_leaves=list(leaves), host_inputs=[])

  def update_tier(self, tier: Tier, base_step: paths.RowStep, arrays, native: bool):
    """Updates one tier, block by block; returns (its new arrays, `(out rows on the
    device, their pieces)` per block).

    Per-subgroup streamed blocks go in the plan's stream order, each one's state let
    into the program only once the block `buffers` before it is back in host memory
    (an optimization barrier), so that at most `buffers` are in flight, as the stacked
    tier's loop unrolled `buffers` times allows.
    """
    blocks = self.part.blocks(tier)
    given = partition_lib.blocks_of(arrays, len(blocks))
    order = list(range(len(blocks)))
    if tier is Tier.STREAMED and len(blocks) > 1:
      first_row = {ids[0]: b for b, ids in enumerate(blocks)}
      order = [first_row[g] for g in self.plan.device if g in first_row]
    new, outs, done = [None] * len(blocks), [None] * len(blocks), []
    for b in order:
      ids, block = blocks[b], given[b]
      if tier is Tier.STREAMED and len(done) >= self.plan.buffers:
        block, _ = lax.optimization_barrier((block, new[done[-self.plan.buffers]]))
      step = dataclasses.replace(
          base_step, decayed_rows=sum(1 for g in ids if g < self.layout.decayed_rows))
      runs = partition_lib.pieces_of(self.layout, ids)
      new[b], out = self._update_block(tier, ids, runs, step, block, native)
      outs[b] = (out, runs)
      done.append(b)
    return tuple(x for block in new for x in block), outs

  def _update_block(self, tier: Tier, ids, runs, step: paths.RowStep, arrays,
                    native: bool):
    """Updates one block (subgroups `ids` of `tier`, whose pieces are `runs`); returns
    (new arrays, out rows on the device)."""
    if tier is Tier.HOST:
      return self._host(step, arrays, runs, native, ids)
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
    order = tuple(range(num_rows))
    if tier is Tier.STREAMED:
      local = {g: i for i, g in enumerate(ids)}
      order = tuple(local[g] for g in self.plan.device if g in local)
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

  def _host(self, step, arrays, runs, native: bool, ids=()):
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
    if native and self.mesh is not None:
      return self._sharded_host_native(step, arrays, ids)
    # Each piece of a host-bound gradient leaves the device on its own, as soon as the
    # backward pass has produced its leaf: never after a concatenation of all gradients.
    grad_pieces = self.host_grad_pieces.get(tuple(ids))
    if grad_pieces is None:
      grad_pieces = paths.to_host(partition_lib.slice_pieces(self.grad_leaves, runs))
    param_pieces = None
    if self.param_leaves is not None:
      param_pieces = paths.to_host(partition_lib.slice_pieces(self.param_leaves, runs))
    if native and self.split:
      arrays, out_h = fused_lib.host_region_update(
          step, self.fused, stacked=arrays, scalars=self.scalars, grad_pieces=grad_pieces,
          param_pieces=param_pieces, runs=runs, num_threads=self.offload.host_threads,
          inputs_sink=self.host_inputs)
    else:
      arrays, out_h = paths.host_region_update(
          step, stacked=arrays, scalars=self.scalars, grad_pieces=grad_pieces,
          param_pieces=param_pieces, runs=runs, grad_dtype=self.grad_dtype,
          region=self.split, inputs_sink=self.host_inputs if self.split else None)
    return paths.put(arrays, paths.HOST), jax.device_put(out_h, paths.DEVICE)

  def _sharded_host_native(self, step, arrays, ids):
    """The accelerator program's host block on a mesh: the native kernel per data
    shard (`fused.sharded_host_region_update`), on gradient rows sent to host memory
    one subgroup at a time (see `host_rows`)."""
    sharding = NamedSharding(self.mesh, P(None, self.offload.data_axis))
    grad_rows = self.host_grad_pieces.get(tuple(ids))
    if grad_rows is None:
      grad_rows = host_rows(self.layout, ids, self.grad_leaves, self.grad_dtype, sharding)
    param_rows = None
    if self.param_leaves is not None:
      param_rows = host_rows(self.layout, ids, self.param_leaves, step.state_dtype, sharding)
    arrays, out_h = fused_lib.sharded_host_region_update(
        step, self.fused, stacked=arrays, scalars=self.scalars, grad_rows=grad_rows,
        param_rows=param_rows, mesh=self.mesh, data_axis=self.offload.data_axis,
        num_threads=self.offload.host_threads, inputs_sink=self.host_inputs)
    return paths.put(arrays, paths.HOST), jax.device_put(out_h, paths.DEVICE)


def host_rows(layout: layout_lib.Layout, ids, leaves: list[Any], dtype,
              sharding: NamedSharding) -> list[jax.Array]:
  """One `(1, S)` row per subgroup of `ids`, assembled on the device from its pieces,
  split over the data axis (`sharding`) and sent to host memory.

  The packed rows of a sharded state cross the leaves' own (tensor) shardings, so
  they are assembled on the device, where XLA can move the pieces between devices.
  Each row leaves the device as soon as the backward pass has made its leaves: the
  early transfer keeps subgroup granularity, never waiting for all gradients.
  """
  size, out = layout.subgroup_size, []
  for g in ids:
    runs = partition_lib.pieces_of(layout, (g,))
    row = partition_lib.assemble(partition_lib.slice_pieces(leaves, runs), runs, 1, size,
                                 dtype)
    out.append(paths.to_host(jax.lax.with_sharding_constraint(row, sharding)))
  return out


def gate_device_update(layout: layout_lib.Layout, part: partition_lib.Partition,
                       grad_leaves: list[Any], rows: tuple[Any, NamedSharding] | None = None
                       ) -> tuple[dict[tuple[int, ...], list[Any]], list[Any]]:
  """Host blocks' gradient pieces sent to host memory, and the gradient leaves for the
  device tiers, through one optimization barrier: `(pieces by block, device leaves)`.

  In the accelerator program the host update (an asynchronous host call) and the device
  update (the streamed and resident tiers) share no value, so XLA's scheduler may place
  them anywhere; it tends to run the device update during the backward pass and the host
  call after it, one after the other. The barrier lets neither start before every
  host-bound gradient piece has arrived in host memory: from there the scheduler's best
  use of the host call's latency is the device update, which it then issues between the
  host call's start and done (checked on the program compiled for an H100,
  tests/test_compiled_gpu.py). Each piece still leaves the device as soon as the
  backward pass has made it, and the two paths stay independent (no value of one flows
  to the other).

  With `rows` (`(dtype, sharding)`: a sharded state's native host path) each block's
  gradients are sent as its subgroups' rows instead (see `host_rows`).
  """
  blocks = part.blocks(Tier.HOST)
  if rows is None:
    pieces = {tuple(ids): paths.to_host(partition_lib.slice_pieces(
        grad_leaves, partition_lib.pieces_of(layout, ids))) for ids in blocks if ids}
  else:
    pieces = {tuple(ids): host_rows(layout, ids, grad_leaves, *rows) for ids in blocks if ids}
  if not pieces or not (part.ids(Tier.STREAMED) or part.ids(Tier.RESIDENT)):
    return pieces, grad_leaves
  pieces, grad_leaves = lax.optimization_barrier((pieces, list(grad_leaves)))
  return pieces, list(grad_leaves)
