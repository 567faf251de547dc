"""Reading a lowered module's MLIR ops: what each op is (`OpKind`), tensor types,
dots, kernel names, and what every function contains (`_Functions`).

The classification the dataflow graph (`graph.py`) is built on; see its docstring for
the markers each kind matches.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Any, Iterable, Iterator

_HOST_PLACEMENTS = frozenset({'pinned_host', 'unpinned_host'})
_DEVICE_PLACEMENTS = frozenset({'device'})
# custom_call targets of Pallas kernels on the GPU (and Mosaic on TPU).
_KERNEL_TARGETS = frozenset({
    '__gpu$xla.gpu.triton',  # Pallas Triton (what JAX 0.10 emits)
    'triton_kernel_call',  # older Pallas Triton and jax-triton
    'mosaic_gpu', 'mosaic_gpu_v2',  # Pallas Mosaic GPU
    'tpu_custom_call',  # Pallas Mosaic TPU
})
_HOST_KERNEL_PREFIX = 'dos_jax_adamw_host'  # kernels/host_adamw_rows.py FFI targets
# Ops whose regions are computations applied to elements (results: where operands are).
_REDUCERS = frozenset({
    'stablehlo.reduce', 'stablehlo.reduce_window', 'stablehlo.scatter',
    'stablehlo.select_and_scatter', 'stablehlo.sort', 'stablehlo.map',
    'stablehlo.all_reduce', 'stablehlo.reduce_scatter'})
# Ops whose result k is their operand k (a loop carry keeps its memory space).
_CARRIES = frozenset({'stablehlo.while', 'stablehlo.optimization_barrier'})


class OpKind(enum.Enum):
  """What an op is; a node has a kind when it or an op anywhere inside it has it."""

  HOST_REGION = 'host region'
  """An op with frontend attribute `_xla_compute_type = "host"`: the `func.call` that
  `compute_on2(..., compute_type='device_host')` lowers to (and the ops of its callee)."""
  PALLAS = 'pallas kernel'
  """A `stablehlo.custom_call` to a Pallas kernel: target `__gpu$xla.gpu.triton`,
  `triton_kernel_call`, `mosaic_gpu`, `mosaic_gpu_v2` or `tpu_custom_call`."""
  HOST_KERNEL = 'native host kernel'
  """A `stablehlo.custom_call` to dos_jax's native host AdamW (`dos_jax_adamw_host*`)."""
  TO_HOST = 'placement in host memory'
  """`custom_call @annotate_device_placement` with `_xla_buffer_placement` =
  `"pinned_host"` or `"unpinned_host"` (it may annotate a value already on the host)."""
  TO_DEVICE = 'placement in device memory'
  """`custom_call @annotate_device_placement` with `_xla_buffer_placement = "device"`."""
  DOT = 'dot_general'
  """A `stablehlo.dot_general` (or `stablehlo.dot`)."""


# ----------------------------------------------------------------------------------
# Reading attributes and types.


def _text(attr: Any) -> str:
  """The string in a StringAttr / FlatSymbolRefAttr, without quotes or `@`."""
  value = getattr(attr, 'value', None)
  if isinstance(value, str):
    return value
  text = str(attr).strip()
  if text.startswith('@'):
    text = text[1:]
  if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
    text = text[1:-1]
  return text


def _entry(attr: Any, key: str) -> Any | None:
  """`attr[key]` for a DictAttr, or None when it has no such entry."""
  if attr is None:
    return None
  try:
    return attr[key] if key in attr else None
  except (TypeError, KeyError, ValueError, IndexError):
    pass
  for named in _iterate(attr):  # bindings without DictAttr.__contains__
    if getattr(named, 'name', None) == key:
      return named.attr
  return None


def _iterate(attr: Any) -> Iterable[Any]:
  try:
    return list(attr)
  except TypeError:
    return []


def _attribute(op: Any, name: str) -> Any | None:
  attrs = op.attributes
  return attrs[name] if name in attrs else None


def _frontend(op: Any, key: str) -> str | None:
  """The frontend attribute `key` of `op` (`mhlo.frontend_attributes = {key = "..."}`)."""
  value = _entry(_attribute(op, 'mhlo.frontend_attributes'), key)
  return None if value is None else _text(value)


_DTYPE_NAMES = {'i1': 'bool', 'bf16': 'bfloat16'}


@dataclasses.dataclass(frozen=True)
class TensorType:
  """The type of a value: shape, dtype and size.

  Attributes:
    shape: dimensions, or None for a non-tensor (a token) or a dynamic shape.
    element_type: the MLIR spelling of the element type, e.g. 'bf16'.
    dtype: the NumPy name of the element type, e.g. 'bfloat16' (the `name` of a
      `jnp.dtype`), or the MLIR spelling when it has none.
    bits: bits per element (0 for a non-tensor).
    text: the whole type as MLIR prints it, e.g. 'tensor<24x32xbf16>'.
  """

  shape: tuple[int, ...] | None
  element_type: str
  dtype: str
  bits: int
  text: str

  @classmethod
  def of(cls, mlir_type: Any) -> 'TensorType':
    text = str(mlir_type)
    element = getattr(mlir_type, 'element_type', None)
    if element is None:
      return cls(None, text, text, 0, text)
    shape = None
    if getattr(mlir_type, 'has_static_shape', False):
      shape = tuple(int(d) for d in mlir_type.shape)
    name = str(element)
    bits = getattr(element, 'width', None)
    if not isinstance(bits, int):
      digits = re.search(r'\d+', name)
      bits = int(digits.group()) if digits else 0
    return cls(shape, name, _numpy_name(name), bits, text)

  @property
  def size(self) -> int:
    return math.prod(self.shape) if self.shape is not None else 0

  @property
  def nbytes(self) -> int:
    """Bytes of the array (a bool takes one byte, as in XLA's buffers)."""
    return self.size * max(1, -(-self.bits // 8))

  def __str__(self) -> str:
    return self.text


def _numpy_name(element: str) -> str:
  if element in _DTYPE_NAMES:
    return _DTYPE_NAMES[element]
  match = re.fullmatch(r'(f|i|ui|si)(\d+)(.*)', element)
  if match:
    prefix, width, rest = match.groups()
    base = {'f': 'float', 'i': 'int', 'si': 'int', 'ui': 'uint'}[prefix]
    return f'{base}{width}' + (f'_{rest.lower()}' if rest else '')
  match = re.fullmatch(r'complex<f(\d+)>', element)
  if match:
    return f'complex{2 * int(match.group(1))}'
  return element


@dataclasses.dataclass(frozen=True)
class Dot:
  """A `dot_general` somewhere in a node: its operand and result types."""

  lhs: TensorType
  rhs: TensorType
  result: TensorType


# ----------------------------------------------------------------------------------
# What an op is, and what it contains.


def _own_kinds(op: Any) -> frozenset[OpKind]:
  """The kinds of `op` itself, not of the ops inside it."""
  name = op.name
  kinds = set()
  if _frontend(op, '_xla_compute_type') == 'host':
    kinds.add(OpKind.HOST_REGION)
  if name in ('stablehlo.dot_general', 'stablehlo.dot'):
    kinds.add(OpKind.DOT)
  elif name == 'stablehlo.custom_call':
    target = _custom_call_target(op)
    if target in _KERNEL_TARGETS:
      kinds.add(OpKind.PALLAS)
    elif target.startswith(_HOST_KERNEL_PREFIX):
      kinds.add(OpKind.HOST_KERNEL)
    elif target == 'annotate_device_placement':
      placement = _frontend(op, '_xla_buffer_placement')
      if placement in _HOST_PLACEMENTS:
        kinds.add(OpKind.TO_HOST)
      elif placement in _DEVICE_PLACEMENTS:
        kinds.add(OpKind.TO_DEVICE)
  return frozenset(kinds)


def _custom_call_target(op: Any) -> str:
  target = _attribute(op, 'call_target_name')
  return '' if target is None else _text(target)


def _kernel_name(op: Any) -> str:
  """The Pallas kernel's `name=` (Triton), or '' where the call does not carry it."""
  config = _attribute(op, 'mhlo.backend_config')
  name = _entry(config, 'name')
  return '' if name is None else _text(name)


def _callees(op: Any) -> list[str]:
  """Functions `op` calls: a `func.call`'s callee, a custom_call's called computations."""
  names = []
  callee = _attribute(op, 'callee')
  if callee is not None:
    names.append(_text(callee))
  called = _attribute(op, 'called_computations')
  if called is not None:
    names.extend(_text(c) for c in _iterate(called))
  return [n for n in names if n]


def _nested_ops(op: Any) -> Iterator[Any]:
  """Every op inside `op`'s regions, at any depth (not into called functions)."""
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        inner = inner.operation
        yield inner
        yield from _nested_ops(inner)


@dataclasses.dataclass
class _Contents:
  """What a node or function contains, itself included."""

  kinds: set[OpKind] = dataclasses.field(default_factory=set)
  dots: list[Dot] = dataclasses.field(default_factory=list)
  kernels: list[str] = dataclasses.field(default_factory=list)

  def add(self, other: '_Contents') -> None:
    self.kinds |= other.kinds
    self.dots.extend(other.dots)
    self.kernels.extend(other.kernels)


class _Functions:
  """The module's functions by name, with what each contains (memoized)."""

  def __init__(self, module: Any):
    self.by_name: dict[str, Any] = {}
    for op in module.body.operations:
      op = op.operation  # a FuncOp view's `name` is its symbol, not 'func.func'
      name = _attribute(op, 'sym_name')
      if name is not None and op.name == 'func.func':
        self.by_name[_text(name)] = op
    self._memo: dict[str, _Contents] = {}
    self._spaces: dict[tuple[str, tuple[str | None, ...]], tuple[str | None, ...]] = {}

  def contents(self, name: str) -> _Contents:
    if name not in self._memo:
      self._memo[name] = _Contents()  # recursion guard (JAX emits no recursion)
      found = _Contents()
      function = self.by_name.get(name)
      if function is not None:
        for region in function.regions:
          for block in region.blocks:
            for op in block.operations:
              found.add(self.op_contents(op.operation))
      self._memo[name] = found
    return self._memo[name]

  def block_spaces(self, block: Any, arguments: tuple[str | None, ...]
                   ) -> dict[Any, str | None]:
    """The memory space of every value defined in `block` (see `Graph.memory_space`),
    given its arguments' spaces."""
    spaces: dict[Any, str | None] = {}
    for i, argument in enumerate(block.arguments):
      spaces[argument] = arguments[i] if i < len(arguments) else None
    space = lambda value: spaces.get(value)  # None: defined outside `block`

    for op in block.operations:
      op = op.operation
      kinds = _own_kinds(op)
      results = list(op.results)
      if kinds & {OpKind.TO_HOST, OpKind.HOST_REGION}:
        out = ['host'] * len(results)
      elif OpKind.TO_DEVICE in kinds:
        out = ['device'] * len(results)
      elif op.name in _CARRIES:
        out = [space(v) for v in op.operands]
      elif op.name == 'func.call':
        out = list(self.result_spaces(_text(op.attributes['callee']),
                                      tuple(space(v) for v in op.operands)))
      elif len(op.regions) and op.name not in _REDUCERS:
        out = [None] * len(results)  # a branch: could return a value from anywhere
      else:
        operands = list(op.operands)
        out = [space(operands[0]) if operands else 'device'] * len(results)
      if len(out) != len(results):
        out = [None] * len(results)
      spaces.update(zip(results, out))
    return spaces

  def result_spaces(self, name: str, arguments: tuple[str | None, ...]
                    ) -> tuple[str | None, ...]:
    """Memory spaces of the results of function `name` called with `arguments`."""
    key = (name, arguments)
    if key not in self._spaces:
      self._spaces[key] = ()  # recursion guard
      function = self.by_name.get(name)
      result = ()
      if function is not None and len(function.regions):
        block = function.regions[0].blocks[0]
        spaces = self.block_spaces(block, arguments)
        returns = [op.operation for op in block.operations][-1:]
        if returns and returns[0].name == 'func.return':
          result = tuple(spaces.get(v) for v in returns[0].operands)
      self._spaces[key] = result
    return self._spaces[key]

  def op_contents(self, op: Any) -> _Contents:
    """What `op` contains: itself, its regions' ops, and (transitively) their callees."""
    found = _Contents()
    for inner in [op, *_nested_ops(op)]:
      found.kinds |= _own_kinds(inner)
      if inner.name in ('stablehlo.dot_general', 'stablehlo.dot'):
        found.dots.append(Dot(*(TensorType.of(v.type) for v in list(inner.operands)[:2]),
                              TensorType.of(inner.results[0].type)))
      elif (inner.name == 'stablehlo.custom_call'
            and _custom_call_target(inner) in _KERNEL_TARGETS):
        found.kernels.append(_kernel_name(inner))
      for callee in _callees(inner):
        found.add(self.contents(callee))
    return found
