"""How one step updates each tier of the state, block by block (see `partition`): the
one place that chooses the path a tier takes, and the small function of each path.

`program.run_step` builds one `StepContext` per traced step and asks it for each
tier's new arrays and output rows (`update_tier`). The path of a tier is chosen once,
by `choose_path`, from the program (`Program`: one memory, or the two-memory program
with its host and device memories), the tier and the implementation asked for; each
`Path` has one method here, which runs the row loop (`row_loop`, one `paths.RowStep`
per row) or the kernels of `kernel_calls`. A stream lane's blocks are one call
(`update_lane`), traced inside the lane's stream region.
The step's AdamW scalars are computed once (`StepContext.adam_scalars`) and handed to
every kernel call.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dos_jax import capability as capability_lib
from dos_jax.step import kernel_calls
from dos_jax.geometry import layout as layout_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax import memory_spaces
from dos_jax.step import paths
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.step.options import StepOptions
from dos_jax.capability import Kernel
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.implementation import Program
from dos_jax.implementation import UpdateImpl
from dos_jax.geometry.partition import Tier
from dos_jax.policies import Plan


class Path(enum.Enum):
  """How one tier's blocks are updated in one step."""

  # One-memory (CPU) program: one native call over the block's rows, reading the
  # gradient leaves in place (sharded: per data shard under shard_map).
  ONE_MEMORY_NATIVE = 'one_memory_native'
  # One-memory program, XLA: the rows packed and updated where they are.
  ONE_MEMORY_XLA = 'one_memory_xla'
  # Two-memory program, host tier: the native kernel in a host region, on gradient
  # pieces sent to host memory as the backward pass makes them.
  HOST_NATIVE = 'host_native'
  # ... the same per data shard (a state sharded over the data axis).
  HOST_NATIVE_SHARDED = 'host_native_sharded'
  # ... XLA's row loop in a host region.
  HOST_XLA = 'host_xla'
  # Two-memory program, streamed tier: rows through the device, prefetched.
  STREAMED = 'streamed'
  # Two-memory program, resident tier: rows updated in device memory.
  RESIDENT = 'resident'


def choose_path(program: Program, tier: Tier, native: bool, sharded: bool) -> Path:
  """The path of `tier` in `program`; `native`: the native host AdamW is asked for and
  usable for this tier; `sharded`: the state is sharded over a mesh."""
  if program is Program.ONE_MEMORY:
    return Path.ONE_MEMORY_NATIVE if native else Path.ONE_MEMORY_XLA
  if tier is Tier.HOST:
    if not native:
      return Path.HOST_XLA
    return Path.HOST_NATIVE_SHARDED if sharded else Path.HOST_NATIVE
  return Path.STREAMED if tier is Tier.STREAMED else Path.RESIDENT


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
  """What every tier's update in one step shares."""

  layout: layout_lib.Layout
  part: partition_lib.Partition
  plan: Plan
  options: StepOptions  # what the step needs of `Offload`
  program: Program
  adamw: AdamWHyperparams | None
  grad_leaves: list[Any]
  param_leaves: list[Any] | None  # only for fp32 params (no master)
  grad_dtype: Any
  scalars: tuple[jax.Array, ...]  # the pre-step scalar state
  new_scalars: tuple[jax.Array, ...]  # after the step (`paths.scalar_update`)
  adam_scalars: AdamWScalars | None  # the AdamW kernels' scalars, once per step
  mesh: Any  # the mesh the state is sharded over (ZeRO-1), or None
  # Two-memory program: each host block's gradient pieces, already sent to host memory
  # (see `gate_device_update`), by the block's subgroups.
  # The Pallas kernel's packed AdamW coefficients (`pallas_adamw.packed_scalars`), made
  # once per step outside every stream region (None: not AdamW).
  coefficients: Any = None
  host_grad_pieces: dict[tuple[int, ...], list[Any]] = dataclasses.field(default_factory=dict)
  # Two-memory program: the host regions' inputs other than the state, appended as the
  # host tier is built (see `gate`).
  host_inputs: list[Any] = dataclasses.field(default_factory=list)
  # Two-memory program: what every host region of the step reads, sent to host memory
  # once (`host_scalars`, `host_row_indices`).
  host_shared: dict[Any, Any] = dataclasses.field(default_factory=dict)

  @property
  def two_memories(self) -> bool:
    """The two-memory program: host and device memories apart."""
    return self.program is Program.TWO_MEMORIES

  def host_scalars(self, speculate: bool = False):
    """`(arrays in host memory, join)`: the step's AdamW scalars as host regions read
    them (`kernel_calls.split_scalars`; with a clip factor of 1 where `speculate`), sent to
    host memory once per step for all of them: XLA's host offloader walks the whole
    program for each array sent there (experiments/RESULTS.md, `construction-compile-g-once`)."""
    key = ('scalars', speculate)
    if key not in self.host_shared:
      adam_scalars = self.adam_scalars
      if speculate:
        adam_scalars = dataclasses.replace(adam_scalars, grad_scale=1.0)
      arrays, join = kernel_calls.split_scalars(adam_scalars)
      self.host_shared[key] = (memory_spaces.to_host(arrays), join)
    return self.host_shared[key]

  def host_row_indices(self, rows: int) -> jax.Array:
    """`0 .. rows - 1` (int32) in host memory, sent once per step for every host region
    of that many rows (see `host_scalars`)."""
    key = ('rows', rows)
    if key not in self.host_shared:
      self.host_shared[key] = memory_spaces.to_host(jnp.arange(rows, dtype=jnp.int32))
    return self.host_shared[key]

  def gate(self) -> 'StepContext':
    """This context with the device tiers' gradients let through an optimization barrier
    together with every input of the host regions built so far (gradient pieces,
    scalars, row indices, all in host memory).

    Then no device update can be issued before the host call's last input is ready, the
    moment the host call can start: the scheduler's use of the host call's latency is
    the device update (see `gate_device_update`, which gates on the gradient pieces
    alone and let small scalar copies slip behind the device loop in some programs).
    """
    if not self.two_memories or not self.host_inputs:
      return self
    _, leaves = lax.optimization_barrier((self.host_inputs, list(self.grad_leaves)))
    return dataclasses.replace(self, grad_leaves=list(leaves), host_inputs=[])

  def update_tier(self, tier: Tier, base_step: paths.RowStep, arrays, native: bool):
    """Updates one tier, block by block, on its path (`choose_path`); returns (its new
    arrays, `(out rows on the device, their pieces)` per block).

    Streamed blocks go in the plan's stream order, each one's state let into the
    program only once the block `buffers` before it is back in host memory (an
    optimization barrier), so that at most `buffers` are in flight.
    """
    blocks = self.part.blocks(tier)
    given = partition_lib.blocks_of(arrays, len(blocks))
    new, outs = self.update_blocks(tier, base_step, dict(enumerate(given)), native)
    return (tuple(x for b in range(len(blocks)) for x in new[b]),
            [outs[b] for b in range(len(blocks))])

  def update_blocks(self, tier: Tier, base_step: paths.RowStep, given: dict[int, tuple],
                    native: bool, in_flight: int | None = None):
    """Updates some of `tier`'s blocks, `given` as {block index: its arrays}; returns
    ({block index: new arrays}, {block index: (out rows on the device, their pieces)}).

    Streamed blocks go in the plan's stream order, each one's state let into the
    program only once the block `in_flight` (default: the plan's `buffers`) before it
    among `given` is back in host memory.
    """
    in_flight = self.plan.buffers if in_flight is None else in_flight
    order = sorted(given)
    if tier is Tier.STREAMED and len(order) > 1:
      order = [b for b in partition_lib.stream_order(self.part, self.plan.streamed)
               if b in given]
    (new,), (outs,) = self.update_lane(self.grad_leaves, [[given[b] for b in order]],
                                       base_step=base_step, work=[(tier, order)],
                                       native=native, in_flight=in_flight)
    blocks = self.part.blocks(tier)
    return dict(zip(order, new)), {
        b: (out, partition_lib.pieces_of(self.layout, blocks[b])) for b, out in zip(order, outs)}

  def update_lane(self, grad_leaves, blocks_in, *, base_step: paths.RowStep, work,
                  native: bool, in_flight: int = 1):
    """The blocks of one stream lane (`lanes.stream_lanes`): `work` its `[(tier, block
    indices)]`, `blocks_in` their arrays (a list per entry), `grad_leaves` the step's
    gradient leaves (passed in, as a stream region's inputs are). Returns (new arrays,
    out rows on the device), a list per entry of `work`. Each streamed block's state
    enters only once the block `in_flight` before it is back in host memory."""
    local = dataclasses.replace(self, grad_leaves=list(grad_leaves))
    new, rows = [], []
    for (tier, indices), arrays in zip(work, blocks_in):
      update = local.path_update(choose_path(self.program, tier, native, self.mesh is not None))
      blocks = self.part.blocks(tier)
      tier_new, tier_rows = [], []
      for b, block in zip(indices, arrays):
        if tier is Tier.STREAMED and len(tier_new) >= in_flight:
          block, _ = lax.optimization_barrier((block, tier_new[-in_flight]))
        ids = blocks[b]
        block, out = update(local.block_step(base_step, ids), block, ids,
                            partition_lib.pieces_of(self.layout, ids))
        tier_new.append(block)
        tier_rows.append(out)
      new.append(tier_new)
      rows.append(tier_rows)
    return new, rows

  def block_step(self, base_step: paths.RowStep, ids) -> paths.RowStep:
    """The row update of the block holding subgroups `ids` (its weight-decayed rows)."""
    return dataclasses.replace(
        base_step, decayed_rows=sum(1 for g in ids if g < self.layout.decayed_rows))

  def path_update(self, path: Path):
    """The method that updates a block on `path`."""
    match path:
      case Path.ONE_MEMORY_NATIVE:
        return self._one_memory_native
      case Path.ONE_MEMORY_XLA:
        return self._one_memory_xla
      case Path.HOST_NATIVE:
        return self._host_native
      case Path.HOST_NATIVE_SHARDED:
        return self._host_native_sharded
      case Path.HOST_XLA:
        return self._host_xla
      case Path.STREAMED:
        return self.streamed
      case Path.RESIDENT:
        return self._resident
    raise AssertionError(path)  # every Path is a case above

  # The paths, one method each: (step, the block's arrays, its subgroups, their pieces)
  # -> (new arrays, out rows on the device).

  def _one_memory_native(self, step, arrays, ids, runs):
    # A one-memory state is one block: the resident tier (device memory) or the host tier.
    resident = self.part.tier_of(ids[0]) is Tier.RESIDENT
    if self.mesh is not None:
      num_rows, size = arrays[0].shape[0], self.layout.subgroup_size
      rows_sharding = NamedSharding(self.mesh, P(None, self.options.data_axis))

      def packed(leaves, dtype):
        shards = self.layout.shards
        rows = partition_lib.assemble(partition_lib.slice_pieces(leaves, runs, shards), runs,
                                      num_rows, size, dtype, shards)
        return jax.lax.with_sharding_constraint(rows, rows_sharding)

      params = None
      if self.param_leaves is not None:
        params = packed(self.param_leaves, step.state_dtype)
      return kernel_calls.sharded_update(
          step, self.adamw, stacked=arrays, adam_scalars=self.adam_scalars,
          grads=packed(self.grad_leaves, self.grad_dtype), params=params, mesh=self.mesh,
          data_axis=self.options.data_axis, resident=resident,
          num_threads=self.options.host_threads)
    if self.part.disk:  # the array holds some subgroups only: their pieces, at local offsets
      leaves = kernel_calls.Leaves(
          grads=partition_lib.slice_pieces(self.grad_leaves, runs),
          offsets=tuple(run.offset for run in runs),
          params=None if self.param_leaves is None
          else partition_lib.slice_pieces(self.param_leaves, runs))
    else:
      leaves = kernel_calls.Leaves(grads=self.grad_leaves, offsets=self.layout.offsets,
                                params=self.param_leaves)
    return kernel_calls.host_update(step, self.adamw, stacked=arrays,
                                 adam_scalars=self.adam_scalars, leaves=leaves,
                                 resident=resident, num_threads=self.options.host_threads)

  def _one_memory_xla(self, step, arrays, ids, runs):
    # The rows are packed where the gradients are and updated where the state is; no
    # op may mix memories, so for a host-memory state the rows go there first.
    grads, params = self.device_rows(step, arrays, runs)
    out = jnp.zeros(grads.shape, step.out_dtype)
    on_host = self.part.tier_of(ids[0]) is Tier.HOST
    if on_host:
      grads, params, out = memory_spaces.to_host((grads, params, out))
    arrays, out = row_loop(range(arrays[0].shape[0]), step, stacked=arrays,
                           scalars=self.scalars, grads=grads, params=params, out=out)
    return arrays, jax.device_put(out, memory_spaces.DEVICE) if on_host else out

  def _host_native(self, step, arrays, ids, runs):
    grad_pieces, param_pieces = self._host_pieces(ids, runs)
    arrays, out, _ = kernel_calls.host_region_update(
        step, self.adamw, stacked=arrays, scalars_h=self.host_scalars(),
        rows_h=self.host_row_indices(arrays[0].shape[0]),
        grad_pieces=grad_pieces, param_pieces=param_pieces, runs=runs,
        num_threads=self.options.host_threads, inputs_sink=self.host_inputs)
    return memory_spaces.put(arrays, memory_spaces.HOST), out

  def _host_native_sharded(self, step, arrays, ids, runs):
    """The native kernel per data shard (`kernel_calls.sharded_host_region_update`), on
    gradient rows sent to host memory one subgroup at a time (see `host_rows`)."""
    del runs
    sharding = NamedSharding(self.mesh, P(None, self.options.data_axis))
    grad_rows = self.host_grad_pieces.get(tuple(ids))
    if grad_rows is None:
      grad_rows = host_rows(self.layout, ids, self.grad_leaves, self.grad_dtype, sharding)
    param_rows = None
    if self.param_leaves is not None:
      param_rows = host_rows(self.layout, ids, self.param_leaves, step.state_dtype, sharding)
    arrays, out = kernel_calls.sharded_host_region_update(
        step, self.adamw, stacked=arrays, adam_scalars=self.adam_scalars,
        grad_rows=grad_rows, param_rows=param_rows, mesh=self.mesh,
        data_axis=self.options.data_axis, num_threads=self.options.host_threads,
        inputs_sink=self.host_inputs)
    return memory_spaces.put(arrays, memory_spaces.HOST), jax.device_put(out, memory_spaces.DEVICE)

  def _host_xla(self, step, arrays, ids, runs):
    """Every row of the host tier in a host region (XLA's loop there), on gradient
    pieces in host memory, assembled into rows there; only the new low-precision
    parameter rows go back to the device."""
    grad_pieces, param_pieces = self._host_pieces(ids, runs)
    num_rows, _, size = arrays[0].shape
    shards, grad_dtype = self.layout.shards, self.grad_dtype
    # Every input of a host region must already be in host memory.
    scale = step.grad_scale
    scalars, scale = memory_spaces.to_host(self.scalars), (
        None if scale is None else memory_spaces.to_host(scale))

    def update(stacked, scalars, grad_pieces, param_pieces, scale):
      grads = partition_lib.assemble(grad_pieces, runs, num_rows, size, grad_dtype, shards)
      params = None
      if param_pieces is not None:
        params = partition_lib.assemble(param_pieces, runs, num_rows, size, step.state_dtype,
                                        shards)
      # The out buffer is made from a host array (a zeros constant would be device
      # memory); every row of it is overwritten.
      out = grads.astype(step.out_dtype)
      return row_loop(tuple(range(num_rows)), dataclasses.replace(step, grad_scale=scale),
                      stacked=stacked, scalars=scalars, grads=grads, params=params, out=out)

    # Everything the region reads but the state (see `gate`).
    self.host_inputs.extend(jax.tree.leaves((scalars, grad_pieces, param_pieces, scale)))
    arrays, out = memory_spaces.host_region(update)(arrays, scalars, grad_pieces, param_pieces,
                                                    scale)
    return memory_spaces.put(arrays, memory_spaces.HOST), jax.device_put(out, memory_spaces.DEVICE)

  def streamed(self, step, arrays, ids, runs):
    """The streamed block through the device, in stream order; returns (arrays, out
    rows)."""
    grads, params = self.device_rows(step, arrays, runs)
    local = {g: i for i, g in enumerate(ids)}
    order = tuple(local[g] for g in self.plan.streamed if g in local)
    out = jnp.zeros(grads.shape, step.out_dtype)
    return row_loop(order, self._device_step(step), stacked=arrays, scalars=self.scalars,
                    grads=grads, params=params, out=out, fetch=True)

  def _resident(self, step, arrays, ids, runs):
    del ids
    grads, params = self.device_rows(step, arrays, runs)
    out = jnp.zeros(grads.shape, step.out_dtype)
    return row_loop(range(arrays[0].shape[0]), self._device_step(step), stacked=arrays,
                    scalars=self.scalars, grads=grads, params=params, out=out)

  # What the paths share.

  def device_rows(self, step, arrays, runs):
    """The block's packed `(R, S)` gradient rows (and fp32 param rows, or None), where
    the gradients are."""
    num_rows, size, shards = arrays[0].shape[0], self.layout.subgroup_size, self.layout.shards
    grads = partition_lib.assemble(partition_lib.slice_pieces(self.grad_leaves, runs, shards),
                                   runs, num_rows, size, self.grad_dtype, shards)
    params = None
    if self.param_leaves is not None:
      params = partition_lib.assemble(
          partition_lib.slice_pieces(self.param_leaves, runs, shards), runs, num_rows, size,
          step.state_dtype, shards)
    return grads, params

  def _host_pieces(self, ids, runs):
    """The host block's gradient (and fp32 param) pieces in host memory. Each piece of a
    host-bound gradient leaves the device on its own, as soon as the backward pass has
    produced its leaf: never after a concatenation of all gradients."""
    grad_pieces = self.host_grad_pieces.get(tuple(ids))
    if grad_pieces is None:
      return self.host_pieces(runs)
    return grad_pieces, self._host_param_pieces(runs)

  def host_pieces(self, runs):
    """The gradient (and fp32 param) pieces of `runs`, sent to host memory."""
    return (memory_spaces.to_host(partition_lib.slice_pieces(self.grad_leaves, runs,
                                                     self.layout.shards)),
            self._host_param_pieces(runs))

  def _host_param_pieces(self, runs):
    """The fp32 param pieces of `runs` in host memory (None: the state keeps a master)."""
    if self.param_leaves is None:
      return None
    return memory_spaces.to_host(partition_lib.slice_pieces(self.param_leaves, runs,
                                                    self.layout.shards))

  def _device_step(self, step):
    """The row update of a device tier: the Pallas AdamW where it is asked for
    (`Implementation.device`) and usable (`capability`), else XLA's."""
    if (self.options.device is UpdateImpl.KERNEL
        and capability_lib.capability(Kernel.PALLAS, self.adamw, step, self.program).usable):
      # Shard-major, every device updates its own columns of the row (no gather).
      sharded = self.mesh is not None and self.layout.shards > 1
      return kernel_calls.device_step(self.adamw, step, self.coefficients, self.new_scalars,
                                   mesh=self.mesh if sharded else None,
                                   axis=self.options.data_axis if sharded else None)
    return step


def _row(x: jax.Array, i) -> jax.Array:
  return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _set_row(x: jax.Array, row: jax.Array, i) -> jax.Array:
  return lax.dynamic_update_index_in_dim(x, row.astype(x.dtype), i, 0)


def _row_index(order: tuple[int, ...], j):
  """The row updated at loop position `j` (a Python int or a traced one)."""
  if isinstance(j, int):
    return order[j]
  if order == tuple(range(len(order))):
    return j
  return jnp.asarray(order, jnp.int32)[j]


def row_loop(order: Sequence[int], step, *, stacked, scalars, grads, params, out,
             fetch: bool = False):
  """Updates the rows `order` of a block with `step` (a `paths.RowStep` or the device
  kernel's), each row written back in place; returns (stacked, out). `grads`, `params`
  and `out` are the block's `(R, S)` rows. `fetch`: the state stays in host memory
  (a streamed block): each row is copied host -> device, updated and copied back, one
  after the other; else it is updated where it is (resident in device memory, in a
  host region, or any tier of a CPU program). A `fori_loop` keeps the compile time
  independent of the number of rows."""
  order = tuple(order)

  def body(j, carry):
    stacked, out = carry
    i = _row_index(order, j)
    blocks = tuple(_row(x, i) for x in stacked)
    if fetch:
      blocks = memory_spaces.put(blocks, memory_spaces.DEVICE)
    param = None if params is None else _row(params, i)
    new_blocks, _, out_row = step(blocks, scalars, _row(grads, i), param, i)
    if fetch:
      new_blocks = memory_spaces.put(new_blocks, memory_spaces.HOST)
    stacked = tuple(_set_row(x, b, i) for x, b in zip(stacked, new_blocks))
    return stacked, _set_row(out, out_row, i)

  return lax.fori_loop(0, len(order), body, (stacked, out))


def host_rows(layout: layout_lib.Layout, ids, leaves: list[Any], dtype,
              sharding: NamedSharding) -> list[jax.Array]:
  """One `(1, S)` row per subgroup of `ids`, assembled on the device from its pieces,
  split over the data axis (`sharding`) and sent to host memory.

  The packed rows of a sharded state cross the leaves' own (tensor) shardings, so
  they are assembled on the device, where XLA can move the pieces between devices.
  Each row leaves the device as soon as the backward pass has made its leaves: the
  early transfer keeps subgroup granularity, never waiting for all gradients.
  """
  size, shards, out = layout.subgroup_size, layout.shards, []
  for g in ids:
    runs = partition_lib.pieces_of(layout, (g,))
    pieces = partition_lib.slice_pieces(leaves, runs, shards)
    row = partition_lib.assemble(pieces, runs, 1, size, dtype, shards)
    out.append(memory_spaces.to_host(jax.lax.with_sharding_constraint(row, sharding)))
  return out


def gate_device_update(layout: layout_lib.Layout, part: partition_lib.Partition,
                       grad_leaves: list[Any], rows: tuple[Any, NamedSharding] | None = None
                       ) -> tuple[dict[tuple[int, ...], list[Any]], list[Any]]:
  """Host blocks' gradient pieces sent to host memory, and the gradient leaves for the
  device tiers, through one optimization barrier: `(pieces by block, device leaves)`.

  In the two-memory program the host update (an asynchronous host call) and the device
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
    pieces = {tuple(ids): memory_spaces.to_host(partition_lib.slice_pieces(
        grad_leaves, partition_lib.pieces_of(layout, ids), layout.shards))
              for ids in blocks if ids}
  else:
    pieces = {tuple(ids): host_rows(layout, ids, grad_leaves, *rows) for ids in blocks if ids}
  if not pieces or not (part.ids(Tier.STREAMED) or part.ids(Tier.RESIDENT)):
    return pieces, grad_leaves
  pieces, grad_leaves = lax.optimization_barrier((pieces, list(grad_leaves)))
  return pieces, list(grad_leaves)
