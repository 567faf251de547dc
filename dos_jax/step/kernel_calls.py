"""The native host AdamW's and the Pallas AdamW's call sites in the step: the host tier
in one native call per step (`kernels.host_adamw_rows`), in place, multi-threaded over
all host elements, and the device rows one Pallas call each (`kernels.pallas_adamw`).

Their scalars are `AdamWHyperparams.scalars` of the step's scalar state, computed once
per step (`step_scalars`), with optax's expressions: results are bit-identical to the
XLA path, which runs `AdamWHyperparams.chain()` row by row.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dos_jax.geometry import slots as slots_lib
from dos_jax.kernels import host_adamw_rows
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax import memory_spaces
from dos_jax import meshes
from dos_jax.memory_spaces import DEVICE
from dos_jax.memory_spaces import HOST
from dos_jax.step import paths
from dos_jax.step.adamw_hyperparams import AdamWHyperparams


def slot_rows(slots: slots_lib.Slots, has_master: bool) -> tuple[int, int, int] | None:
  """`(master_k or -1, mu_k, nu_k)` in the single stacked group, or None if the state
  is not laid out as one group holding (master,) mu, nu."""
  if len(slots.groups) != 1 or slots.groups[0] != 'float32':
    return None
  master, inner = slots.treedef.unflatten(slots.places)
  try:
    mu, nu = inner[0].mu, inner[0].nu
  except (AttributeError, IndexError, TypeError):
    return None
  places = (master,) if has_master else ()
  if any(group != 0 for group, _ in places + (mu, nu)):
    return None
  return (master[1] if has_master else -1, mu[1], nu[1])


def step_scalars(adamw: AdamWHyperparams, step: paths.RowStep,
                 scalar_update: tuple[Any, Any, tuple]) -> AdamWScalars:
  """The step's `AdamWScalars`, from the scalar state before the step (the first of
  `paths.scalar_update`'s results), with the step's gradient scale (the clip factor)
  folded in. Computed once per step; every kernel call of the step takes it."""
  adam_scalars = adamw.scalars(scalar_update[0])
  if step.grad_scale is not None:
    adam_scalars = dataclasses.replace(adam_scalars, grad_scale=step.grad_scale)
  return adam_scalars


def split_scalars(adam_scalars: AdamWScalars):
  """`(arrays, join)`: the step's array scalars (schedule value, bias corrections, clip
  factor), which cross into host regions and `shard_map`s as operands, and
  `join(arrays)` rebuilding the `AdamWScalars` from them there. Python floats stay
  closed over (never traced), which `AdamWScalars` rounds as optax does.

  Float32 scalars cross as one vector: XLA's host offloader walks the whole program
  for each array sent to host memory (experiments/RESULTS.md,
  `construction-compile-g-both`)."""
  leaves, tree = jax.tree.flatten(adam_scalars)
  is_array = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]
  packed = len(arrays) > 1 and all(x.shape == () and x.dtype == jnp.float32 for x in arrays)

  def join(crossed):
    it = iter([crossed[0][i] for i in range(len(arrays))] if packed else crossed)
    return tree.unflatten([next(it) if a else x for x, a in zip(leaves, is_array)])

  return ([jnp.stack(arrays)] if packed else arrays), join


@dataclasses.dataclass(frozen=True, eq=False)
class Leaves:
  """The gradient (and, for fp32 params, param) leaves and their flat offsets in the
  layout, for the kernel to read in place of the packed rows."""

  grads: list[Any]
  params: list[Any] | None
  offsets: tuple[int, ...]


def host_update(step: paths.RowStep, adamw: AdamWHyperparams, *, stacked,
                adam_scalars: AdamWScalars, leaves: Leaves, resident: bool,
                num_threads: int | None = None):
  """Every row of a one-memory (CPU program) state in one native call; returns
  (stacked, out rows).

  The kernel reads the gradient (and param) leaves directly, so the packed `(G, S)`
  rows are never built, and writes a fresh out buffer (every row of it; the kernel
  asks for huge pages for it, see adamw_common.h; why not over the gradients:
  docs/design.md).
  """
  num_rows = stacked[0].shape[0]
  new_state, out = host_adamw_rows.adamw_host_leaves(
      stacked[0], leaves.grads, None if step.has_master else leaves.params,
      jnp.arange(num_rows, dtype=jnp.int32), adam_scalars, offsets=leaves.offsets,
      slots=slot_rows(step.slots, step.has_master), decayed_rows=step.decayed_rows,
      lowp_dtype=step.out_dtype, nesterov=adamw.nesterov, num_threads=num_threads)
  # A custom call's results are typed as device memory; the state keeps its memory
  # kind (on CPU both are one memory, and this is no copy: see the memory test).
  space = DEVICE if resident else HOST
  return (jax.device_put(new_state, space),), out


def threads_per_shard(mesh=None) -> int:
  """The host threads of one device's native call: every device of `mesh` (None: every
  device) in this process runs its call at once, so they share the cores. `mesh` may
  be abstract (as under `auto_axes`)."""
  local = jax.local_device_count()
  if mesh is not None:
    local = min(mesh.size, local)
  return max(1, (os.cpu_count() or 1) // max(1, local))


def sharded_update(step: paths.RowStep, adamw: AdamWHyperparams, *, stacked,
                   adam_scalars: AdamWScalars, grads, params, mesh, data_axis: str,
                   resident: bool, num_threads: int | None = None):
  """One-memory (CPU program) state sharded over `data_axis` (ZeRO-1): the native call
  runs on every device's shard under `shard_map`; returns (stacked, out rows).

  Each subgroup row is split along its elements, so a shard holds `(G, K, S / n)` of
  the state and needs the matching `(G, S / n)` columns of the packed gradient (and
  param) rows, given here sharded like the state.
  """
  arrays, join = split_scalars(adam_scalars)
  num_rows = stacked[0].shape[0]
  if num_threads is None:
    num_threads = threads_per_shard(mesh)
  kernel_args = dict(
      slots=slot_rows(step.slots, step.has_master), decayed_rows=step.decayed_rows,
      lowp_dtype=step.out_dtype, nesterov=adamw.nesterov, num_threads=num_threads,
      indexed=True)
  rows_spec, state_spec = P(None, data_axis), P(None, None, data_axis)

  def per_shard(state, grads, arrays, *params):
    return host_adamw_rows.adamw_host_rows(
        state, grads, params[0] if params else None,
        jnp.arange(num_rows, dtype=jnp.int32), join(arrays), **kernel_args)

  extra = () if params is None else (params,)
  # The native call has no replication rule for the checker; every output is sharded.
  new_state, out = jax.shard_map(
      per_shard, mesh=mesh,
      in_specs=(state_spec, rows_spec, [P()] * len(arrays)) + (rows_spec,) * len(extra),
      out_specs=(state_spec, rows_spec), check_vma=False,
  )(stacked[0], grads, arrays, *extra)
  space = DEVICE if resident else HOST
  return (jax.device_put(new_state, space),), out


def region_kernel_args(step: paths.RowStep, adamw: AdamWHyperparams, runs,
                       num_threads: int | None) -> dict:
  """The native host AdamW's arguments for a block's host region: its pieces' offsets in
  the block's rows, the slots, its decayed rows, nesterov and the thread count."""
  return dict(offsets=tuple(run.offset for run in runs),
              slots=slot_rows(step.slots, step.has_master), decayed_rows=step.decayed_rows,
              nesterov=adamw.nesterov, num_threads=num_threads)


def state_in_place(in_place, with_result):
  """The host tier's state update in the form the platform keeps in order, as a function
  of the update's arguments: `in_place` (the kernel writes the donated state in its
  buffer, which leaves through an optimization barrier) where the program is lowered
  for a GPU, and `with_result` (the state a result of the host region, a copy per step)
  on a CPU backend, where the two-memory program runs only as a test of its numbers.
  Each platform lowers only its own branch (docs/design.md, "The host state in place").
  """
  return functools.partial(jax.lax.platform_dependent, cpu=with_result, default=in_place)


def host_region_update(step: paths.RowStep, adamw: AdamWHyperparams, *, stacked, scalars_h,
                       rows_h, grad_pieces, param_pieces, runs,
                       num_threads: int | None = None, inputs_sink: list | None = None,
                       link=None):
  """The host tier in one native call inside a host region (the two-memory program);
  returns (stacked, out rows in device memory, link token in device memory).

  `scalars_h` (`(arrays in host memory, join)`: `split_scalars`'s, sent to host
  memory) and `rows_h` (the row indices `0 .. R - 1`, int32, in host memory) are the
  step's, shared by its host regions (`tier_updates.StepContext.host_scalars`).

  `link` (a `(1,)` float32 zero in host memory, or None): the previous chunk's link,
  read by the kernel call through its row indices, so that XLA keeps this region its
  own host call (see `dos_jax.step.early_calls`). The token returned is computed from the out
  rows, in device memory.

  `grad_pieces` (and `param_pieces` for fp32 params) are the tier's `partition.Piece`
  runs, already in host memory: the kernel reads them at their offsets in the tier's
  rows, so the rows are never assembled. `step.decayed_rows` is the tier's own.

  The state is updated in place, in the buffer it arrives in (the donated state), and
  is not a result of the region. XLA makes a host region an asynchronous host call whose
  results get buffers of their own: its arguments stay live until the call is done, and
  the call carries no input/output aliasing (XLA's host-call wrapper creates it without
  any, and nothing in StableHLO sets it), so a state result cannot share the donated
  state's buffer and copy insertion copies it back, host to host, on every step (the
  whole tier). Instead the kernel writes the state in its argument (`state_in_arg`),
  the region returns only the out rows, and the state leaves through an optimization
  barrier with them: whatever reads the new state runs after the host call is done.
  Nothing else in the step reads the old host state. Donate the state (every training
  step does): without donation XLA copies it into the output after the call, as it
  must, and the caller's state array is overwritten as well. On a CPU backend the
  region returns the state (`state_in_place`).
  """
  arrays_h, join = scalars_h
  kernel_args = dict(region_kernel_args(step, adamw, runs, num_threads),
                     lowp_dtype=step.out_dtype)

  def run(state, grad_pieces, param_pieces, rows_h, arrays_h, link, state_in_arg=False):
    scalars_h = join(arrays_h)
    if link is not None:  # exactly zero: the indices do not change
      rows_h = rows_h + link[0].astype(rows_h.dtype)
    result = host_adamw_rows.adamw_host_leaves(
        state, grad_pieces, param_pieces, rows_h, scalars_h, state_in_arg=state_in_arg,
        **kernel_args)
    new_state, out = (None, result) if state_in_arg else result
    token = out[:1, :1].reshape(1).astype(jnp.float32)
    return (out, token) if state_in_arg else (new_state, out, token)

  args = (stacked[0], grad_pieces, param_pieces, rows_h, arrays_h, link)
  if inputs_sink is not None:
    # Not the link: what gates on these inputs (a device update) must not wait for the
    # earlier host calls the link comes from.
    inputs_sink.extend(jax.tree.leaves(args[1:-1]))
  spaces = (HOST, DEVICE)

  def in_place(*args):
    out_h, token = memory_spaces.host_region(functools.partial(run, state_in_arg=True),
                                             out_spaces=spaces)(*args)
    out = memory_spaces.put(out_h, DEVICE)
    new_state, out = jax.lax.optimization_barrier((args[0], out))
    return new_state, out, token

  def with_result(*args):
    new_state, out_h, token = memory_spaces.host_region(run, out_spaces=(HOST,) + spaces)(*args)
    return new_state, memory_spaces.put(out_h, DEVICE), token

  new_state, out, token = state_in_place(in_place, with_result)(*args)
  return (new_state,), out, token


def sharded_host_region_update(step: paths.RowStep, adamw: AdamWHyperparams, *, stacked,
                               adam_scalars: AdamWScalars, grad_rows, param_rows, mesh,
                               data_axis: str, num_threads: int | None = None,
                               inputs_sink: list | None = None):
  """The host tier of a state sharded over `data_axis` (ZeRO-1) in the accelerator
  program: on every device, one native call on its shard inside a host region (under
  `shard_map`); returns (stacked, out rows in host memory).

  `grad_rows` (and `param_rows` for fp32 params) hold one `(1, S)` row per subgroup of
  the tier, in host memory, sharded like the state (`P(None, data)`): a shard's `(1,
  S / n)` pieces are read in place as the kernel's leaves at offsets `r * S / n` of
  its `(R, K, S / n)` state, so nothing is concatenated on the host. Row padding is
  zero in the gradients and in the state, so the kernel leaves it zero.
  `step.decayed_rows` is the tier's own.
  """
  num_rows, _, size = stacked[0].shape
  local_size = size // mesh.shape[data_axis]
  # Array scalars (schedule value, bias corrections, clip factor) cross whole to every
  # shard; Python floats stay closed over (see `host_region_update`).
  arrays, join = split_scalars(adam_scalars)
  arrays_h = memory_spaces.to_host(arrays)
  if num_threads is None:
    num_threads = threads_per_shard(mesh)
  kernel_args = dict(
      offsets=tuple(r * local_size for r in range(num_rows)),
      slots=slot_rows(step.slots, step.has_master), decayed_rows=step.decayed_rows,
      lowp_dtype=step.out_dtype, nesterov=adamw.nesterov, num_threads=num_threads)

  def run(state, grad_rows, param_rows, rows_h, arrays_h):
    return host_adamw_rows.adamw_host_leaves(
        state, grad_rows, param_rows, rows_h, join(arrays_h), **kernel_args)

  if inputs_sink is not None:
    inputs_sink.extend(jax.tree.leaves((list(grad_rows), arrays_h, param_rows)))

  def per_shard(state, grad_rows, arrays_h, *param_rows):
    rows_h = memory_spaces.to_host(jnp.arange(num_rows, dtype=jnp.int32))
    return memory_spaces.host_region(run)(state, grad_rows, param_rows[0] if param_rows else None,
                                  rows_h, arrays_h)

  rows_spec, state_spec = P(None, data_axis), P(None, None, data_axis)
  extra = () if param_rows is None else (list(param_rows),)
  # The native call has no replication rule for the checker; every output is sharded.
  new_state, out_h = jax.shard_map(
      per_shard, mesh=mesh,
      in_specs=(state_spec, [rows_spec] * num_rows, [P()] * len(arrays_h))
      + ([rows_spec] * num_rows,) * len(extra),
      out_specs=(state_spec, rows_spec), check_vma=False,
  )(stacked[0], list(grad_rows), arrays_h, *extra)
  return (new_state,), out_h


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceKernelStep:
  """A `paths.RowStep` replacement for the device path: one Pallas AdamW per streamed
  subgroup, on its state block in device memory, producing the new 16-bit parameter row
  in the same pass. Same call signature as `RowStep`.

  The kernel is opaque to XLA, so no fusion can re-read the old block after the write:
  the barrier `RowStep` needs is not needed here. On a CPU backend the same program runs
  the kernel in Pallas' interpreter (how CI checks the two-memory program's numbers).
  """

  step: paths.RowStep
  adamw: AdamWHyperparams
  # The step's AdamW coefficients as the kernel reads them (`pallas_adamw.packed_scalars`),
  # made once per step outside every stream region (`StepContext.coefficients`).
  coefficients: jax.Array
  new_scalars: tuple
  # A shard-major state (ZeRO-3, `layout.Layout.shards`): the mesh and the axis its rows
  # are split over. The kernel then runs on each device's columns of the row under
  # `shard_map`; XLA would otherwise gather the whole row's state to call it.
  mesh: Any = None
  axis: str | None = None

  def __call__(self, blocks, scalars, grad, param, index):
    del scalars  # every row reads the pre-step scalars, folded into `coefficients`
    if self.mesh is not None:
      return self._per_shard(blocks[0], grad, param, index)
    from dos_jax.kernels import pallas_adamw  # pylint: disable=import-outside-toplevel
    block, step = blocks[0], self.step
    size = block.shape[-1]
    limit = jnp.reshape(jnp.where(index < step.decayed_rows, size, 0).astype(jnp.int32), (1,))
    kernel = functools.partial(
        pallas_adamw.adamw_pallas_rows_packed, self.coefficients, limit,
        slots=slot_rows(step.slots, step.has_master),
        lowp_dtype=step.out_dtype if step.has_master else None, nesterov=self.adamw.nesterov)
    # Triton where the program is lowered for a GPU, the Pallas interpreter where it
    # runs on a CPU backend: each platform lowers only its own branch. The block is
    # updated where it is, in one buffer (no row slices, no stacking).
    new_block, new_master, lowp = jax.lax.platform_dependent(
        block, grad, None if step.has_master else param,
        cpu=functools.partial(kernel, interpret=True),
        default=functools.partial(kernel, interpret=False))
    if step.has_master:
      out_row = lowp
    else:
      # fp32 params are their own master: the out row is the update.
      out_row = (new_master - param).astype(step.out_dtype)
    return (new_block,), self.new_scalars, out_row

  def _per_shard(self, block, grad, param, index):
    """The kernel on each device's columns of the row, under `shard_map`."""
    def per_shard(block, grad, index, coefficients, *param):
      unsharded = dataclasses.replace(self, coefficients=coefficients, mesh=None, axis=None)
      (new_block,), _, out_row = unsharded((block,), None, grad, param[0] if param else None,
                                           index)
      return new_block, out_row

    mesh = meshes.as_traced(self.mesh)
    rows, row = P(None, self.axis), P(self.axis)
    extra = () if param is None else (param,)
    # The Pallas call has no replication rule for the checker; every output is sharded.
    new_block, out_row = jax.shard_map(
        per_shard, mesh=mesh,
        in_specs=(rows, row, P(), P()) + (row,) * len(extra),
        out_specs=(rows, row), check_vma=False,
    )(block, grad, jnp.asarray(index), self.coefficients, *extra)
    return (new_block,), self.new_scalars, out_row


def device_step(adamw: AdamWHyperparams, step: paths.RowStep, coefficients: jax.Array,
                new_scalars: tuple, mesh: Any = None,
                axis: str | None = None) -> DeviceKernelStep:
  """The Pallas row update with the step's packed `coefficients`; per shard of
  `mesh`'s `axis` when given (see `DeviceKernelStep`)."""
  return DeviceKernelStep(step=step, adamw=adamw, coefficients=coefficients,
                          new_scalars=new_scalars, mesh=mesh, axis=axis)
