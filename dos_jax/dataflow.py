"""The dataflow graph of a lowered program: what the GPU program does, seen on any machine.

A step lowered for the GPU on a machine without one
(`jax.jit(step).trace(...).lower(lowering_platforms=('cuda',))`) is StableHLO whose
def-use graph shows what XLA may overlap: two ops with no path between them can run at
the same time, an op that (transitively) uses another's result cannot start before it.
`Graph` walks the entry function's top-level ops, attributing everything nested in an
op (loop bodies, called functions, host regions) to that op, and answers which ops
depend on which. The tests use it to prove the shape of dos_jax's GPU program: the host
region and the device stream are independent, and host-bound gradients leave the device
before the backward pass ends.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable


class OpKind(enum.Enum):
  """What a top-level op does, itself or anywhere inside it."""

  HOST_REGION = 'host region'  # a call with _xla_compute_type = "host"
  PALLAS = 'pallas kernel'  # a Triton (Pallas) GPU kernel call
  HOST_KERNEL = 'native host kernel'  # dos_jax's native host AdamW custom call
  TO_HOST = 'copy to host memory'  # annotate_device_placement to pinned_host
  TO_DEVICE = 'copy to device memory'  # annotate_device_placement to device
  DOT = 'dot_general'


def _own_kinds(op) -> set[OpKind]:
  name = op.name
  attrs = op.attributes
  kinds = set()
  if name == 'stablehlo.dot_general':
    kinds.add(OpKind.DOT)
  if name == 'func.call' and 'mhlo.frontend_attributes' in attrs:
    if '_xla_compute_type = "host"' in str(attrs['mhlo.frontend_attributes']):
      kinds.add(OpKind.HOST_REGION)
  if name == 'stablehlo.custom_call':
    target = str(attrs['call_target_name']).strip('"')
    if target.startswith('__gpu$xla.gpu.triton'):
      kinds.add(OpKind.PALLAS)
    elif target.startswith('dos_jax_adamw_host'):
      kinds.add(OpKind.HOST_KERNEL)
    elif target == 'annotate_device_placement' and 'mhlo.frontend_attributes' in attrs:
      placement = str(attrs['mhlo.frontend_attributes'])
      if '"pinned_host"' in placement or '"unpinned_host"' in placement:
        kinds.add(OpKind.TO_HOST)
      elif '"device"' in placement:
        kinds.add(OpKind.TO_DEVICE)
  return kinds


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
  """One top-level op of the entry function.

  Attributes:
    index: position in the entry function (operands come before their users).
    name: the op's name, e.g. 'stablehlo.while'.
    kinds: what it does, itself or inside it.
    result_types: its results' types as text, e.g. 'tensor<24x32xbf16>'.
    op: the MLIR operation.
  """

  index: int
  name: str
  kinds: frozenset[OpKind]
  result_types: tuple[str, ...]
  op: Any


class Graph:
  """Top-level def-use graph of a module's entry function (`main`)."""

  def __init__(self, module):
    functions = {}
    for op in module.body.operations:
      if 'sym_name' in op.attributes:
        functions[str(op.attributes['sym_name']).strip('"')] = op
    entry = functions['main']
    memo: dict[str, frozenset[OpKind]] = {}

    def kinds_of_function(name: str) -> frozenset[OpKind]:
      if name not in memo:
        memo[name] = frozenset()  # recursion guard
        found: set[OpKind] = set()
        for region in functions[name].regions:
          for block in region.blocks:
            for inner in block.operations:
              found |= kinds_of(inner)
        memo[name] = frozenset(found)
      return memo[name]

    def kinds_of(op) -> set[OpKind]:
      found = _own_kinds(op)
      if op.name == 'func.call':
        callee = str(op.attributes['callee']).lstrip('@')
        if callee in functions:
          found |= kinds_of_function(callee)
      for region in op.regions:
        for block in region.blocks:
          for inner in block.operations:
            found |= kinds_of(inner)
      return found

    ops = list(entry.regions[0].blocks[0].operations)
    position = {}
    for i, op in enumerate(ops):
      for result in op.results:
        position[result] = i
    self.nodes: list[Node] = []
    self._ancestors: list[int] = []  # bitset of each node's transitive operands
    for i, op in enumerate(ops):
      bits = 0
      for operand in op.operands:
        j = position.get(operand)
        if j is not None:
          bits |= (1 << j) | self._ancestors[j]
      self._ancestors.append(bits)
      self.nodes.append(Node(
          index=i, name=op.name, kinds=frozenset(kinds_of(op)),
          result_types=tuple(str(r.type) for r in op.results), op=op))

  @classmethod
  def from_lowered(cls, lowered) -> 'Graph':
    """The graph of a `jax.stages.Lowered`."""
    return cls(lowered.compiler_ir('stablehlo'))

  def with_kind(self, kind: OpKind) -> list[Node]:
    """Top-level nodes that do `kind`, themselves or inside them."""
    return [n for n in self.nodes if kind in n.kinds]

  def depends(self, user: Node, producer: Node) -> bool:
    """Whether `user` uses, directly or through other ops, a result of `producer`."""
    return bool(self._ancestors[user.index] >> producer.index & 1)

  def ancestors(self, node: Node) -> list[Node]:
    bits = self._ancestors[node.index]
    return [n for n in self.nodes if bits >> n.index & 1]


def lower_for_gpu(fn: Callable[..., Any], *args, **jit_kwargs):
  """`fn` jitted and lowered for CUDA: works on a machine without a GPU."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.jit(fn, **jit_kwargs).trace(*args).lower(lowering_platforms=('cuda',))
