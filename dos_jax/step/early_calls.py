"""The host tier in K host calls that start during the backward pass.

The two-memory program splits the host subgroups into calls in backward order (the last
subgroups first: the backward pass makes their gradients first; those without weight
decay last, `host_blocks`): early calls of the sizes in `Partition.early` (what
`dos_jax.planner.timeline.choose_early_calls` or the fixed rule
`partition.early_host_calls` gives) and a last one with the rest
(`partition.host_calls`). All calls but the last are *early*: each is its own host call
whose inputs are its gradient pieces in host memory, the step's AdamW scalars and the
link of the call before it, so it can start once its gradients have crossed, while the
backward pass still runs (where the start lands is the latency-hiding scheduler's
choice: docs/design.md, rule 6). Call K, the last (its gradients come last), runs after
the backward pass in one scheduling group with the device tiers' stream calls, as the
step with one host call does (`dos_jax.step.device_stream`: its stream lanes).

The link keeps the calls apart: early call k's kernel reads a `(1,)` zero computed on
the device from a token of call k-1's out rows (see below why a device op is needed).

**Speculation.** Under `dos_jax.clip_by_global_norm` the clip factor needs every
gradient, so an early call cannot know it. It updates with a factor of 1, and its
kernel keeps a copy of every state element it overwrites (`keep_undo`). After the
backward pass, in the last call's host call, a redo kernel runs per early block: when
the step's factor is not exactly 1 (the norm reached the clip, or is not finite), it
puts the copy back and updates again with the true factor; otherwise it touches nothing.
A factor of exactly 1 multiplies each gradient by 1, so the speculated update is the
unspeculated one bit for bit, and a redone update is the unspeculated update itself.
The new params of early blocks go back to the device after the redo call. Without
clipping there is nothing to speculate on: early calls use the step's scalars and
their params leave at once.

The cost: a host copy of the early calls' state (their undo), alive from the early
call to the redo call, and, on a rollback step, the early calls' host work twice
(`dos_jax.planner.timeline`). On a GPU the kernel library keeps that copy, found by the
state buffer both calls update in place, and reuses its pages from step to step: as a
result of the early call, XLA:GPU would place it in device memory (a host call's result
that another host call reads is device memory there) and copy it back for the redo.
The redo comes after its early call through the link.

Why a device op links the calls: XLA:GPU regroups the host instructions of a program into
host calls, and includes one disconnected from the current call in it; one reachable
only through a device instruction starts a new call (docs/design.md, JAX facts). The
link is exactly zero (`zero_of`): the host kernel's row indices, and so its results, are
those of one host call bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dos_jax.geometry import columns as columns_lib
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import Tier
from dos_jax.kernels import host_adamw_rows
from dos_jax.step import device_stream
from dos_jax.step import kernel_calls
from dos_jax import memory_spaces
from dos_jax.memory_spaces import DEVICE
from dos_jax.memory_spaces import HOST
from dos_jax.step.host_work import HostItem
from dos_jax.step.host_work import HostWork
from dos_jax.step import paths


def host_blocks(part: partition_lib.Partition, decayed_rows: int | None = None) -> list[int]:
  """The host blocks (one per subgroup) in the order their host calls run: the last
  subgroups first, whose gradients the backward pass makes first. Given the layout's
  `decayed_rows`, the blocks past them come last: they hold the leaves without weight
  decay (the norm scales of every layer), whose gradients are complete only when the
  backward pass reaches the first layer (and, split over a mesh, once their combined
  reduction is done).

  >>> import dos_jax
  >>> from dos_jax.geometry import partition
  >>> part = partition.for_plan(dos_jax.Plan(streamed=(0, 2, 4), host=(1, 3, 5)),
  ...                           two_memories=True)
  >>> [part.blocks(partition.Tier.HOST)[b] for b in host_blocks(part, decayed_rows=5)]
  [(3,), (1,), (5,)]
  """
  blocks = part.blocks(Tier.HOST)
  order = list(range(len(blocks)))[::-1]
  if decayed_rows is None:
    return order
  late = [b for b in order if min(blocks[b]) >= decayed_rows]
  return [b for b in order if b not in late] + late


def zero_of(x: jax.Array) -> jax.Array:
  """An exact float32 zero computed from `x` (finite or not)."""
  x = x.reshape(-1)[:1].astype(jnp.float32)
  return jnp.where(jnp.isfinite(x), x, 0) * 0


def redo_flag(adam_scalars) -> jax.Array | None:
  """Whether the early calls must be redone: the clip factor is not exactly 1 (None
  when the step has no clip factor, and nothing speculates)."""
  factor = adam_scalars.grad_scale
  if not isinstance(factor, jax.Array):
    return None
  return jnp.reshape(factor, ()) != 1.0


def redo_on_host(redo) -> jax.Array:
  """The redo flag as the redo kernel reads it: an int32 `(1,)` in host memory.
  Computed once per step before the scheduling group (a device op inside it would
  carry the group's annotation, and XLA keeps a group for asynchronous ops alone)."""
  return memory_spaces.to_host(jnp.reshape(redo, (1,)).astype(jnp.int32))


def _rows_after(rows_h, link):
  return rows_h + link[0].astype(rows_h.dtype)  # exactly zero: the indices do not change


def speculate_region(step: paths.RowStep, adamw, *, stacked, scalars_h, rows_h, grad_pieces,
                     param_pieces, runs, num_threads=None, link=None):
  """An early block's host call with a clip factor of 1, keeping its undo; returns
  `(state, out rows in device memory, undo, token in device memory)` for `redo_region`.
  `scalars_h` and `rows_h` as `kernel_calls.host_region_update` takes them (the scalars with a
  clip factor of 1: `StepContext.host_scalars(speculate=True)`).

  On a GPU the state is updated in its (donated) buffer, as `kernel_calls.host_region_update`
  does, and is read by the redo call; the kernel keeps the undo itself, found by that
  buffer (`keep_undo`: as a result of the host call it would be device memory), and
  `undo` is the state. On a CPU backend (`kernel_calls.state_in_place`) the state is a result
  and the undo is the old state itself.
  """
  arrays_h, join = scalars_h  # with a clip factor of 1
  kernel_args = kernel_calls.region_kernel_args(step, adamw, runs, num_threads)

  def run(state, grad_pieces, param_pieces, rows_h, arrays_h, link, in_place):
    if link is not None:
      rows_h = _rows_after(rows_h, link)
    result = host_adamw_rows.adamw_host_leaves(
        state, grad_pieces, param_pieces, rows_h, join(arrays_h), lowp_dtype=step.out_dtype,
        state_in_arg=in_place, keep_undo=in_place, **kernel_args)
    out = result if in_place else result[1]
    token = out[:1, :1].reshape(1).astype(jnp.float32)
    return (out, token) if in_place else (result[0], out, token)

  args = (stacked[0], grad_pieces, param_pieces, rows_h, arrays_h, link)

  def in_place(*args):
    out_h, token = memory_spaces.host_region(
        functools.partial(run, in_place=True), out_spaces=(HOST, DEVICE))(*args)
    return args[0], memory_spaces.put(out_h, DEVICE), args[0], token

  def with_result(*args):
    new_state, out_h, token = memory_spaces.host_region(
        functools.partial(run, in_place=False), out_spaces=(HOST, HOST, DEVICE))(*args)
    return new_state, memory_spaces.put(out_h, DEVICE), args[0], token

  return kernel_calls.state_in_place(in_place, with_result)(*args)


def redo_region(step: paths.RowStep, adamw, *, state, out, undo, redo, scalars_h, rows_h,
                grad_pieces, param_pieces, runs, num_threads=None, link=None,
                redo_h=None):
  """After the backward pass: an early block's update redone with the true scalars when
  `redo` (a device bool; `redo_h`, its `redo_on_host`, if already made) is true;
  returns `((state,), out)`, `out()` giving the out rows
  in device memory: the speculated `out` (already on the device) unless `redo`. Call it
  outside the scheduling group the redo call is in (a conditional is no asynchronous
  op, and a group holds only those).

  The redone out rows are a result of the redo call, so whatever reads them comes after
  it in every schedule. They are device memory: XLA:GPU gives a host call's results
  device buffers when the program reads them there, and asked for host memory it would
  copy them back to the host only for the conditional to fetch them again.
  """
  arrays_h, join = scalars_h
  kernel_args = kernel_calls.region_kernel_args(step, adamw, runs, num_threads)
  redo_h = redo_on_host(redo) if redo_h is None else redo_h

  def in_place(state, undo, redo_h, grad_pieces, param_pieces, rows_h, arrays_h, link):
    del undo  # the kernel's own copy, kept by the speculated call on the same buffer

    def run(state, redo_h, grad_pieces, param_pieces, rows_h, arrays_h, link):
      if link is not None:
        rows_h = _rows_after(rows_h, link)
      return host_adamw_rows.adamw_host_leaves_redo(
          state, grad_pieces, param_pieces, rows_h, join(arrays_h), redo=redo_h,
          lowp_dtype=step.out_dtype, **kernel_args)

    again = memory_spaces.host_region(run, out_spaces=DEVICE)(
        state, redo_h, grad_pieces, param_pieces, rows_h, arrays_h, link)
    return jax.lax.optimization_barrier((state, again))

  def with_result(state, undo, redo_h, grad_pieces, param_pieces, rows_h, arrays_h, link):
    def run(undo, grad_pieces, param_pieces, rows_h, arrays_h, link):
      if link is not None:
        rows_h = _rows_after(rows_h, link)
      return host_adamw_rows.adamw_host_leaves(
          undo, grad_pieces, param_pieces, rows_h, join(arrays_h), lowp_dtype=step.out_dtype,
          **kernel_args)

    again_state, again = memory_spaces.host_region(run, out_spaces=(HOST, DEVICE))(
        undo, grad_pieces, param_pieces, rows_h, arrays_h, link)
    return jnp.where(redo_h[0] != 0, again_state, state), again

  state, again = kernel_calls.state_in_place(in_place, with_result)(
      state, undo, redo_h, grad_pieces, param_pieces, rows_h, arrays_h, link)
  return (state,), lambda: jax.lax.cond(redo, lambda: memory_spaces.put(again, DEVICE),
                                        lambda: out)


def host_work(context, base_step: paths.RowStep, host_tier: tuple, early,
              columns: int = 1) -> HostWork:
  """The host tier of a per-subgroup state in host calls as
  `partition.host_calls(..., early)` gives them (see the module docstring): the early
  calls traced now, what runs after the backward pass (the last call's blocks, each in
  up to `columns` regions by columns, `Construction.host_columns`; then each early
  block's redo) as the items of the returned `HostWork`, whose `finish()` gives (the
  tier's new arrays, `(out rows on the device, pieces)` per region).
  """
  part, layout = context.part, context.layout
  blocks = part.blocks(Tier.HOST)
  new = list(partition_lib.blocks_of(host_tier, len(blocks)))
  parts = partition_lib.host_calls(host_blocks(part, layout.decayed_rows), early)
  redo = redo_flag(context.adam_scalars)
  # What every region reads, sent to host memory once, outside the calls' contexts
  # (the redo flag and the speculated scalars only where early calls speculate).
  speculates = redo is not None and len(parts) > 1
  redo_h = redo_on_host(redo) if speculates else None
  threads = dict(num_threads=context.options.host_threads)
  scalars_h = context.host_scalars()
  speculated_h = context.host_scalars(speculate=True) if speculates else None
  rows_h = [context.host_row_indices(block[0].shape[0]) for block in new]
  outs, redone, link = [], [], None

  def block_args(b, runs=None):
    """The block's step and its gradient (and param) pieces (`runs`, default all of
    the block's), sent to host memory."""
    runs = partition_lib.pieces_of(layout, blocks[b]) if runs is None else runs
    grad_pieces, param_pieces = context.host_pieces(runs)
    return context.block_step(base_step, blocks[b]), dict(
        grad_pieces=grad_pieces, param_pieces=param_pieces, runs=runs, rows_h=rows_h[b])

  def call_inputs(b, runs):  # traced where the call is, inside its group
    step, piece_args = block_args(b, runs)
    return dict(piece_args, step=step, stacked=new[b])

  def record_call(b, runs, result):
    arrays, out, token = result
    new[b] = memory_spaces.put(arrays, HOST)
    outs.append((out, runs))
    return token

  def record_redo(b, runs, result):
    arrays, again = result
    new[b] = memory_spaces.put(arrays, HOST)
    redone.append((again, runs))
    return again

  region_args = dict(adamw=context.adamw, scalars_h=scalars_h, **threads)
  pending = []
  for index, call_blocks in enumerate(parts[:-1]):
    with device_stream.early_call(index):
      tokens = []
      for b in call_blocks:
        step, piece_args = block_args(b)
        if redo is None:
          tokens.append(record_call(b, piece_args['runs'], kernel_calls.host_region_update(
              step, stacked=new[b], link=link, **piece_args, **region_args)))
          continue
        state, out, undo, token = speculate_region(
            step, context.adamw, stacked=new[b], link=link, **piece_args,
            scalars_h=speculated_h, **threads)
        pending.append(HostItem(
            region=functools.partial(redo_region, step, context.adamw, state=state, out=out,
                                     undo=undo, redo=redo, redo_h=redo_h, **piece_args,
                                     scalars_h=scalars_h, **threads),
            record=functools.partial(record_redo, b, piece_args['runs'])))
        tokens.append(token)
      link = link_after(tokens)

  def finish():
    return (tuple(x for block in new for x in block),
            outs + [(out(), runs) for out, runs in redone])

  # Column-major: consecutive regions are other subgroups' (a stage holds one of each).
  columns_of = {b: column_runs(layout, blocks[b], columns) for b in parts[-1]}
  items = [HostItem(region=functools.partial(kernel_calls.host_region_update,
                                            inputs_sink=context.host_inputs, **region_args),
                    inputs=functools.partial(call_inputs, b, runs),
                    record=functools.partial(record_call, b, runs))
           for k in range(max(map(len, columns_of.values()), default=0))
           for b in parts[-1] for runs in columns_of[b][k:k + 1]]
  return HostWork(items=items + pending, finish=finish, link=link)


def column_runs(layout, ids, columns: int) -> tuple:
  """The runs of each host region of a block of subgroups `ids`: the block's pieces for
  one region, else `columns.split_pieces`'s column parts."""
  pieces = partition_lib.pieces_of(layout, ids)
  return (pieces,) if columns <= 1 else columns_lib.split_pieces(pieces, columns)


def link_after(tokens) -> jax.Array:
  """The link of the host calls after those whose `tokens` are given: an exact zero in
  host memory computed on the device from every token (a redo's: its out-rows thunk)."""
  return memory_spaces.to_host(sum(zero_of(t() if callable(t) else t) for t in tokens))


def update_host(context, base_step: paths.RowStep, host_tier: tuple, early, group=None):
  """`host_work(...)` traced with its items in one host call in scheduling group
  `group` (None: in none): (new arrays, `(out rows, pieces)` per block)."""
  return host_work(context, base_step, host_tier, early).run_grouped(group)
