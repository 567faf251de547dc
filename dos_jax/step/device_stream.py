"""A function run on a GPU stream of its own, scheduled together with the host call.

`on_stream(fn, group)` stages `fn` out as one call that XLA's GPU compiler runs as an
asynchronous pair on another CUDA stream (the call carries `_xla_stream_annotation`, as
`compute_on('gpu_stream:1')` does) and places in scheduling group `group`
(`_scheduling_group_id`). `in_group(group)` puts the host regions traced inside it in
the same group. XLA's latency-hiding scheduler places a group's instructions in one go,
each asynchronous done before any start, so the host call and the stream's windows
overlap in every schedule (docs/design.md, "Concurrent by construction").

How much a group may hold (`lanes.grouped_lanes`): the scheduler counts every
asynchronous call in flight (host call, stream call, and the copies between host and
device memory inside a stream call) against
`xla_gpu_experimental_parallel_async_compute_limit`, 2 unless set, and a group it
cannot place whole within that limit stops the compile
(`RET_CHECK ... Couldn't find an annotated node to schedule`). So a group holds the
host call and one stream call fewer than the limit, each running its copies one after
another; the other stream calls of a step carry the group only as `LANES_ATTRIBUTE`,
which names them for the program's readers (`dataflow.streamed_rows`) and which XLA
ignores.

Group ids are numbered per traced program (`next_group`), so tracing one step twice
gives the same program text.

The call returns one tuple, unpacked by `get-tuple-element`s outside it: XLA copies a
call's frontend attributes to the `get-tuple-element`s it makes for a multi-result call,
and would turn each of them into a stream pair of its own, between the stream's done and
the group's other instructions.

On a CPU (and without a GPU compiler) the annotations are ignored: the call is a call.

>>> import jax, jax.numpy as jnp
>>> f = on_stream(lambda a, b: (a + b, a * b), group=next_group())
>>> [x.tolist() for x in jax.jit(f)(jnp.ones(2), jnp.full(2, 3.0))]
[[4.0, 4.0], [3.0, 3.0]]
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from dos_jax.kernels import jax_internals
from dos_jax.kernels.jax_internals import core
from dos_jax.kernels.jax_internals import func_dialect
from dos_jax.kernels.jax_internals import hlo
from dos_jax.kernels.jax_internals import ir
from dos_jax.kernels.jax_internals import mlir
from dos_jax.kernels.jax_internals import pe

STREAM = 1  # the first CUDA stream of the device tiers' update (0 is XLA's compute stream)
_FIRST_GROUP = 7000
# The frontend attribute naming the stream calls of one step's device tiers (its value:
# their group id), grouped or not.
LANES_ATTRIBUTE = '_dos_jax_lanes'
# {the outermost trace of a program being traced: the next group id in it}.
_groups: 'weakref.WeakKeyDictionary[Any, itertools.count]' = weakref.WeakKeyDictionary()

_TAKES_CLOSED = jax_internals.CALLED_TAKES_CLOSED

stream_region_p = core.Primitive('dos_jax_stream_region')
stream_region_p.multiple_results = True


def next_group() -> int:
  """A scheduling group id no other group of the program being traced uses: numbered
  from 7000 in the order the program asks for them, so that the same step traced
  twice (in one process or two) is the same program text. Outside a trace, numbered
  in this process."""
  trace = _outermost_trace()
  try:
    counter = _groups.setdefault(trace, itertools.count(_FIRST_GROUP))
  except TypeError:  # a trace that takes no weak reference: number it in the process
    counter = _groups.setdefault(_groups_of_process, itertools.count(_FIRST_GROUP))
  return next(counter)


class _Process:
  """The key of the groups numbered outside any trace we can tell apart."""


_groups_of_process = _Process()


def _outermost_trace() -> Any:
  """The trace of the program being traced (the jit's, not a `cond` or `shard_map`
  body's inside it); `_groups_of_process` outside a trace."""
  trace = getattr(getattr(core, 'trace_ctx', None), 'trace', None)
  outer = None
  while trace is not None and type(trace).__name__ != 'EvalTrace':
    outer, trace = trace, getattr(trace, 'parent_trace', None)
  return _groups_of_process if outer is None else outer


def in_group(group: int):
  """Context: the operations traced inside join scheduling group `group` (host regions
  keep it on their host call)."""
  return set_xla_metadata(**{jax_internals.SCHEDULING_GROUP: group})


EARLY_CALL_ATTRIBUTE = '_dos_jax_early_call'


def early_call(index: int):
  """Context: the host regions traced inside belong to early host call `index` (0, 1,
  ... in the step's order); its host call carries the frontend attribute
  `EARLY_CALL_ATTRIBUTE` in the compiled program, where `dataflow.early_windows` finds
  it (and counts the calls in the lowered step)."""
  return set_xla_metadata(**{EARLY_CALL_ATTRIBUTE: str(index)})


LATE_CALL_ATTRIBUTE = '_dos_jax_late_call'


def late_call(index: int):
  """Context: the host regions traced inside belong to host call `index` of those after
  the early calls (the staged lowering makes one per stage); `dataflow.early_windows`
  counts them in the lowered step."""
  return set_xla_metadata(**{LATE_CALL_ATTRIBUTE: str(index)})


def on_stream(fn: Callable[..., Any], group: int | None,
              stream: int = STREAM, lanes: int | None = None) -> Callable[..., Any]:
  """`fn` (arrays in, a pytree of arrays out, no side effects) as one region on GPU
  stream `stream` (1 or more; 0 is XLA's compute stream), in scheduling group `group`
  (None: in none), one of the device-tier lanes named `lanes` (`LANES_ATTRIBUTE`;
  None: of none). Arrays `fn` closes over are passed in.

  XLA runs a region's instructions one after another on its stream, its copies between
  host and device memory included (they are not asynchronous there): two regions on
  two streams are what lets one's copies run while the other's do
  (docs/design.md, rule 3)."""
  _check_stream(stream)

  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return bind(closed, out_shape, args, group, stream=stream, lanes=lanes)

  return wrapped


def bind(closed, out_shape, args: tuple, group: int | None, stream: int = STREAM,
         lanes: int | None = None) -> Any:
  """`on_stream` of a function already traced on `args`: `closed, out_shape =
  jax.make_jaxpr(fn, return_shape=True)(*args)`."""
  _check_stream(stream)
  if closed.effects:
    raise ValueError(f'dos_jax: a stream region cannot have effects: {closed.effects}')
  consts, jaxpr = _without_consts(closed)
  attributes = ((jax_internals.STREAM_ANNOTATION, str(stream)), ('inlineable', 'false'))
  if group is not None:
    attributes += ((jax_internals.SCHEDULING_GROUP, str(group)),)
  if lanes is not None:
    attributes += ((LANES_ATTRIBUTE, str(lanes)),)
  outs = stream_region_p.bind(*consts, *jax.tree.leaves(args), jaxpr=jaxpr,
                              attributes=attributes)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _check_stream(stream: int) -> None:
  if stream < 1:
    raise ValueError(f'dos_jax: a stream region needs a stream of its own (1 or more), '
                     f'got stream={stream}')


def _without_consts(closed) -> tuple[list[Any], Any]:
  """(the consts, the jaxpr taking them as its first inputs): a ClosedJaxpr without
  consts (jax 0.10, 0.11) or a Jaxpr, which holds its consts itself (0.12)."""
  opened = pe.convert_constvars_jaxpr(closed.jaxpr)
  if hasattr(core, 'ClosedJaxpr'):
    return list(closed.consts), core.ClosedJaxpr(opened, ())
  return list(closed.consts), opened


def _impl(*args, jaxpr, attributes):
  del attributes
  return core.jaxpr_as_fun(jaxpr)(*args)


def _abstract_eval(*avals, jaxpr, attributes):
  del avals, attributes
  return jaxpr.out_avals


def _lowering(ctx, *args, jaxpr, attributes):
  called = jaxpr if _TAKES_CLOSED or not hasattr(core, 'ClosedJaxpr') else jaxpr.jaxpr
  region, output_types, effects = mlir.lower_called_computation(
      'dos_jax_stream_region', called, ctx.module_context, 0, ctx.avals_in, ctx.avals_out,
      ctx.tokens_in)
  assert not effects, effects
  flat_types, treedef = mlir.ir_tree_registry.flatten(output_types)
  tuple_type = ir.TupleType.get_tuple(flat_types)
  # A wrapper returning the results as one tuple: XLA makes no get-tuple-element of the
  # annotated call but the ones below, which carry no attributes.
  module = ctx.module_context
  wrapper = func_dialect.FuncOp(
      'dos_jax_stream_tuple', ir.FunctionType.get(list(region.type.inputs), [tuple_type]),
      ip=module.ip)
  wrapper.attributes['sym_visibility'] = ir.StringAttr.get('private')
  module.symbol_table.insert(wrapper)
  block = wrapper.add_entry_block()
  with ir.InsertionPoint(block):
    inner = func_dialect.CallOp(flat_types, ir.FlatSymbolRefAttr.get(region.name.value),
                                list(block.arguments))
    func_dialect.ReturnOp([hlo.tuple(list(inner.results))])
  flat_args, _ = mlir.ir_tree_registry.flatten((*ctx.dim_var_values, *args))
  call = func_dialect.CallOp([tuple_type], ir.FlatSymbolRefAttr.get(wrapper.name.value),
                             flat_args)
  call.operation.attributes['mhlo.frontend_attributes'] = ir.DictAttr.get(
      {key: ir.StringAttr.get(value) for key, value in attributes})
  outs = [hlo.get_tuple_element(call.result, i) for i in range(len(flat_types))]
  return treedef.unflatten(outs)


stream_region_p.def_impl(_impl)
stream_region_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(stream_region_p, _lowering)
