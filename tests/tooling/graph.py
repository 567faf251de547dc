"""The dataflow graph of a lowered program: what the GPU program does, seen on any machine.

A step lowered for the GPU on a machine without one (`dos_jax.dataflow.lower_for_gpu`, i.e.
`jax.jit(step).trace(...).lower(lowering_platforms=('cuda',))`) is StableHLO whose
def-use graph shows what XLA may overlap: two ops with no path between them can run at
the same time, an op that (transitively) uses another's result cannot start before it.
`Graph` walks the entry function's (`@main`'s) top-level ops and attributes everything
nested in an op to that op: the ops in its regions (`stablehlo.while` bodies,
`stablehlo.case` branches) and, transitively, the ops of the functions it calls
(`func.call`; JAX outlines jitted and closed-over pieces into `func.func private`
functions, also from inside loop bodies). The tests use it to prove the shape of
dos_jax's GPU program without a GPU: the host region and the device stream are
independent, and host-bound gradients leave the device before the backward pass ends.

It reads the MLIR Python objects of `Lowered.compiler_ir('stablehlo')` (op names,
attributes, operands, results), never the printed module, and imports nothing private
from JAX. What each `OpKind` matches is in its docstring; the markers were read off
JAX 0.10's lowering:

* host region: `func.call @compute_on(...) {mhlo.frontend_attributes =
  {_xla_compute_type = "host"}}` (`compute_on2(f, compute_type='device_host', ...)`
  on JAX 0.10, `compute_on` on 0.11; JAX also stamps the attribute on every op inside
  the callee);
* transfer: `stablehlo.custom_call @annotate_device_placement(x)
  {mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host" | "device"}}`
  (`jax.device_put(x, jax.memory.Space.Host | Device)` inside jit). JAX also wraps every
  output of a host region in one, `"pinned_host"` for a host-resident output: an
  annotation of a value that is already there, which moves nothing (`Transfer.moves`);
* Pallas kernel: `stablehlo.custom_call @__gpu$xla.gpu.triton` (Triton; its
  `mhlo.backend_config` dictionary holds the kernel's `name`) or `@mosaic_gpu_v2`
  (Mosaic GPU; no name outside the serialized kernel).

`Graph.memory_space` tells where a top-level value lives, so that a placement of a value
already in that memory is not counted as a transfer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from tests.tooling.ops import (
    _HOST_PLACEMENTS,
    Dot,
    OpKind,
    TensorType,
    _attribute,
    _entry,
    _frontend,
    _Functions,
    _iterate,
    _nested_ops,
    _own_kinds,
    _text,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
  """One top-level op of the entry function, standing for everything inside it.

  Attributes:
    index: position in the entry function (an op comes after the ops it uses).
    name: the op's name, e.g. 'stablehlo.while', 'func.call'.
    own_kinds: what the op itself is.
    kinds: what it or any op inside it (regions, called functions, transitively) is.
    callee: the function a `func.call` calls, else None.
    operand_types: its operands' types.
    result_types: its results' types as MLIR prints them, e.g. 'tensor<24x32xbf16>'.
    results: its results' types.
    dots: every `dot_general` in it (itself included), in program order.
    kernel_names: the name of every Pallas kernel called in it ('' where the call does
      not carry one: Mosaic GPU).
    op: the MLIR operation (valid while the graph, which holds the module, lives).
  """

  index: int
  name: str
  own_kinds: frozenset[OpKind]
  kinds: frozenset[OpKind]
  callee: str | None
  operand_types: tuple[TensorType, ...]
  result_types: tuple[str, ...]
  results: tuple[TensorType, ...]
  dots: tuple[Dot, ...]
  kernel_names: tuple[str, ...]
  op: Any

  def __repr__(self) -> str:
    kinds = ','.join(sorted(k.name for k in self.kinds))
    callee = f' @{self.callee}' if self.callee else ''
    return f'Node(#{self.index} {self.name}{callee} [{kinds}])'


@dataclasses.dataclass(frozen=True)
class Transfer:
  """A top-level `annotate_device_placement`: a value placed in host or device memory.

  Attributes:
    node: the annotation's node.
    to: 'host' or 'device'.
    placement: the `_xla_buffer_placement` value, e.g. 'pinned_host'.
    type: the value moved (shape, dtype, bytes).
    source: where the value was before (`Graph.memory_space` of the annotated value):
      'host', 'device', or None when the graph cannot tell (a `stablehlo.case`
      result).

  JAX wraps every output of a host region in an annotation, `"pinned_host"` for one
  left in host memory, and `device_put` inside jit annotates even a value that is
  already in the requested memory: such a transfer moves nothing (`moves` is False).
  """

  node: Node
  to: str
  placement: str
  type: TensorType
  source: str | None

  @property
  def moves(self) -> bool:
    """False when the value is known to be in `to` already: a no-op annotation.

    An unknown source counts as moving.
    """
    return self.source != self.to


class Graph:
  """The top-level def-use graph of a lowered module's entry function.

  Dependence is def-use between top-level ops only: an op nested in a region or a
  called function is represented by its top-level op, and a top-level op uses every
  top-level value that it or an op in its regions reads (branches of `stablehlo.case`
  read outer values directly). Ancestor sets are bitsets over node indices.

  Attributes:
    nodes: the entry function's top-level ops, in program order (its `func.return`
      last).
    module: the MLIR module (kept alive for the nodes' ops).
  """

  def __init__(self, module: Any, entry: str = 'main'):
    """Builds the graph of `module`, an `ir.Module` (e.g. `compiler_ir('stablehlo')`)."""
    self.module = module
    functions = _Functions(module)
    if entry not in functions.by_name:
      raise ValueError(f'no function @{entry} in the module; it has '
                       f'{sorted(functions.by_name)}')
    self._function = functions.by_name[entry]
    block = self._function.regions[0].blocks[0]
    ops = [op.operation for op in block.operations]
    position = {}
    for i, op in enumerate(ops):
      for result in op.results:
        position[result] = i

    self.nodes: list[Node] = []
    self._ancestors: list[int] = []  # bit j of [i]: node i transitively uses node j
    self._operands: list[tuple[int, ...]] = []  # direct uses
    for i, op in enumerate(ops):
      uses = set()
      for inner in [op, *_nested_ops(op)]:
        for operand in inner.operands:
          j = position.get(operand)
          if j is not None and j != i:
            uses.add(j)
      bits = 0
      for j in uses:
        bits |= (1 << j) | self._ancestors[j]
      self._ancestors.append(bits)
      self._operands.append(tuple(sorted(uses)))
      contents = functions.op_contents(op)
      callee = _attribute(op, 'callee') if op.name == 'func.call' else None
      self.nodes.append(Node(
          index=i, name=op.name, own_kinds=_own_kinds(op),
          kinds=frozenset(contents.kinds),
          callee=None if callee is None else _text(callee),
          operand_types=tuple(TensorType.of(v.type) for v in op.operands),
          result_types=tuple(str(r.type) for r in op.results),
          results=tuple(TensorType.of(r.type) for r in op.results),
          dots=tuple(contents.dots), kernel_names=tuple(contents.kernels), op=op))
    self._descendants: list[int] | None = None
    self._block = block
    self._functions = functions
    self._spaces: dict[Any, str | None] | None = None  # memory space of each value

  @classmethod
  def from_lowered(cls, lowered: Any) -> 'Graph':
    """The graph of a `jax.stages.Lowered` (e.g. from `lower_for_gpu`)."""
    return cls(lowered.compiler_ir('stablehlo'))

  def __len__(self) -> int:
    return len(self.nodes)

  def __iter__(self) -> Iterator[Node]:
    return iter(self.nodes)

  # Kinds.

  def nodes_containing(self, kind: OpKind) -> list[Node]:
    """Top-level nodes that are `kind` or have an op of that kind anywhere inside."""
    return [n for n in self.nodes if kind in n.kinds]

  with_kind = nodes_containing  # the name tests/test_gpu_program.py uses

  def host_regions(self) -> list[Node]:
    """Top-level nodes that are host-compute regions themselves (the `func.call`s)."""
    return [n for n in self.nodes if OpKind.HOST_REGION in n.own_kinds]

  def kernel_calls(self, name: str | None = None) -> list[Node]:
    """Nodes that run a Pallas kernel (named `name`, when given) somewhere inside."""
    return [n for n in self.nodes if OpKind.PALLAS in n.kinds
            and (name is None or name in n.kernel_names)]

  def dots(self) -> list[tuple[Node, Dot]]:
    """Every dot_general of the program with its top-level node, in program order."""
    return [(n, d) for n in self.nodes for d in n.dots]

  # Dependence.

  def depends(self, user: Node, producer: Node) -> bool:
    """Whether `user` uses, directly or through other ops, a result of `producer`."""
    return bool(self._ancestors[user.index] >> producer.index & 1)

  def independent(self, a: Node, b: Node) -> bool:
    """Neither uses a result of the other: XLA may run them at the same time."""
    return a is not b and not self.depends(a, b) and not self.depends(b, a)

  def operands(self, node: Node) -> list[Node]:
    """Nodes whose results `node` (or an op in its regions) uses directly."""
    return [self.nodes[j] for j in self._operands[node.index]]

  def ancestors(self, node: Node) -> list[Node]:
    """Nodes that `node` transitively uses, in program order."""
    return self._select(self._ancestors[node.index])

  def descendants(self, node: Node) -> list[Node]:
    """Nodes that transitively use `node`, in program order."""
    if self._descendants is None:
      below = [0] * len(self.nodes)
      for i in reversed(range(len(self.nodes))):
        for j in self._operands[i]:
          below[j] |= (1 << i) | below[i]
      self._descendants = below
    return self._select(self._descendants[node.index])

  def _select(self, bits: int) -> list[Node]:
    out = []
    while bits:
      low = bits & -bits
      out.append(self.nodes[low.bit_length() - 1])
      bits ^= low
    return out

  # Transfers.

  def transfers_to_host(self, include_noops: bool = False) -> list[Transfer]:
    """Top-level placements in host memory; by default only those that move data.

    A transfer nested in a loop or a called function is not listed: find the node
    that holds it with `nodes_containing(OpKind.TO_HOST)`.
    """
    return self._transfers('host', include_noops)

  def transfers_to_device(self, include_noops: bool = False) -> list[Transfer]:
    """Top-level placements in device memory; by default only those that move data."""
    return self._transfers('device', include_noops)

  def _transfers(self, to: str, include_noops: bool) -> list[Transfer]:
    kind = OpKind.TO_HOST if to == 'host' else OpKind.TO_DEVICE
    out = []
    for node in self.nodes:
      if kind not in node.own_kinds:
        continue
      operand = node.op.operands[0]
      transfer = Transfer(node=node, to=to,
                          placement=_frontend(node.op, '_xla_buffer_placement') or '',
                          type=TensorType.of(operand.type), source=self._space_of(operand))
      if include_noops or transfer.moves:
        out.append(transfer)
    return out

  def memory_space(self, node: Node, result: int = 0) -> str | None:
    """Where `node`'s result lives: 'host', 'device', or None when not known.

    Follows JAX's rules for memory spaces as the lowered program shows them: a
    placement annotation puts its result where it says, a host region's results are
    in host memory, a loop carry stays where its initial value was, a `func.call`'s
    result is where its callee's is (given where the arguments are), an op's result is
    where its first operand is (JAX requires an op's arrays to share a memory space),
    and an op with no operands (a constant) is on the device. Unknown (None): the
    results of branches (`stablehlo.case`, `stablehlo.if`) and of other ops with
    regions that are not reductions (e.g. `sdy.manual_computation`).
    """
    return self._space_of(node.op.results[result])

  def _space_of(self, value: Any) -> str | None:
    if self._spaces is None:
      self._spaces = self._functions.block_spaces(self._block, self._argument_spaces())
    return self._spaces.get(value)

  def _argument_spaces(self) -> tuple[str, ...]:
    """Each entry argument's memory space, from its `mhlo.memory_kind`."""
    attrs = _iterate(_attribute(self._function, 'arg_attrs'))
    spaces = []
    for i in range(len(self._block.arguments)):
      kind = _entry(attrs[i], 'mhlo.memory_kind') if i < len(attrs) else None
      spaces.append('host' if kind is not None and _text(kind) in _HOST_PLACEMENTS
                    else 'device')
    return tuple(spaces)
