"""Reading a scheduled HLO module (the text of a compiled program) instruction by instruction.

A compiled XLA module (`HloModule ..., is_scheduled=true`) lists each computation's
instructions in the order they will be issued, so position is schedule order. This
module only parses: which computations there are, each instruction's name, shape(s),
memory spaces, opcode, operands and attributes. `schedule.py` reads meaning into it.

Memory spaces appear in layouts: `f32[4,1024]{1,0:S(5)}` is host memory (XLA's memory
space 5, `pinned_host`); no `S(n)` is device memory.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

HOST_MEMORY_SPACE = 5

_DTYPE_BYTES = {
    'pred': 1, 's4': 1, 'u4': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
    's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4,
    's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16,
}
_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?')
_SPACE = re.compile(r'S\((\d+)\)')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%([^\s(]+)\s*\(')


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's shape: dtype, dims and memory space."""

  dtype: str
  dims: tuple[int, ...]
  memory_space: int

  @property
  def nbytes(self) -> int:
    count = 1
    for d in self.dims:
      count *= d
    return count * _DTYPE_BYTES.get(self.dtype, 4)

  @property
  def on_host(self) -> bool:
    return self.memory_space == HOST_MEMORY_SPACE


def arrays_of(shape: str) -> tuple[Array, ...]:
  """Every array in a shape's text (a tuple's elements, nested tuples flattened)."""
  found = []
  for m in _ARRAY.finditer(shape):
    dtype, dims, layout = m.group(1), m.group(2), m.group(3) or ''
    if dtype == 'token':
      continue
    space = _SPACE.search(layout)
    found.append(Array(dtype=dtype, dims=tuple(int(d) for d in dims.split(',') if d),
                       memory_space=int(space.group(1)) if space else 0))
  return tuple(found)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction as printed."""

  name: str
  shape: str  # the result shape's text
  opcode: str
  operands: tuple[str, ...]  # operand names, without '%'
  attributes: str  # everything after the operand list
  position: int  # index in its computation's schedule

  @property
  def arrays(self) -> tuple[Array, ...]:
    return arrays_of(self.shape)

  def attribute(self, key: str) -> str | None:
    """The value of `key=...` (up to the next top-level ', '), or None."""
    m = re.search(r'(?:^|, )' + re.escape(key) + r'=', self.attributes)
    if m is None:
      return None
    return _until_top_level_comma(self.attributes[m.end():])

  @property
  def called(self) -> tuple[str, ...]:
    """Names of the computations this instruction calls (calls=, body=, to_apply=...)."""
    names = []
    for key in ('calls', 'called_computations', 'body', 'condition', 'to_apply',
                'branch_computations'):
      value = self.attribute(key)
      if value:
        names.extend(n.strip().lstrip('%') for n in value.strip('{}').split(','))
    return tuple(n for n in names if n)


@dataclasses.dataclass(frozen=True)
class Computation:
  name: str
  is_entry: bool
  execution_thread: str  # 'main', or 'host' for a host computation
  instructions: tuple[Instruction, ...]

  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}


@dataclasses.dataclass(frozen=True)
class Module:
  """A parsed HLO module: its computations by name, the entry's name."""

  computations: dict[str, Computation]
  entry: str
  is_scheduled: bool

  @classmethod
  def parse(cls, text: str) -> 'Module':
    computations, entry = {}, ''
    current, instructions, is_entry = None, [], False
    for line in text.splitlines():
      if current is None:
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith('{'):
          current, is_entry, instructions = m.group(2), bool(m.group(1)), []
        continue
      if line.startswith('}'):
        thread = re.search(r'execution_thread="([^"]+)"', line)
        computations[current] = Computation(
            name=current, is_entry=is_entry,
            execution_thread=thread.group(1) if thread else 'main',
            instructions=tuple(instructions))
        if is_entry:
          entry = current
        current = None
        continue
      parsed = _instruction(line, len(instructions))
      if parsed is not None:
        instructions.append(parsed)
    head = text.split('\n', 1)[0]
    return cls(computations=computations, entry=entry,
               is_scheduled='is_scheduled=true' in head)

  @property
  def entry_computation(self) -> Computation:
    return self.computations[self.entry]

  def reachable(self, name: str) -> Iterator[Computation]:
    """`name` and every computation it calls, transitively, each once."""
    seen, stack = set(), [name]
    while stack:
      current = stack.pop()
      if current in seen or current not in self.computations:
        continue
      seen.add(current)
      computation = self.computations[current]
      yield computation
      for instruction in computation.instructions:
        stack.extend(instruction.called)


def _until_top_level_comma(text: str) -> str:
  depth, quote = 0, False
  for i, ch in enumerate(text):
    if ch == '"' and (i == 0 or text[i - 1] != '\\'):
      quote = not quote
    elif not quote:
      if ch in '({[':
        depth += 1
      elif ch in ')}]':
        if depth == 0:
          return text[:i]
        depth -= 1
      elif ch == ',' and depth == 0:
        return text[:i]
  return text


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at `text[start]`."""
  pairs = {'(': ')', '{': '}', '[': ']'}
  depth, quote = 0, False
  for i in range(start, len(text)):
    ch = text[i]
    if ch == '"' and text[i - 1] != '\\':
      quote = not quote
    elif not quote and ch in pairs:
      depth += 1
    elif not quote and ch in pairs.values():
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _instruction(line: str, position: int) -> Instruction | None:
  text = line.strip()
  if text.startswith('ROOT '):
    text = text[5:]
  if not text.startswith('%') or ' = ' not in text:
    return None
  name, _, rest = text.partition(' = ')
  if rest.startswith('('):
    end = _balanced(rest, 0)
  else:
    end = rest.find(' ')
    end = len(rest) if end < 0 else end
  shape, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r'([a-z][a-zA-Z0-9\-_$.]*)\(', rest)
  if m is None:
    return None
  opcode = m.group(1)
  close = _balanced(rest, m.end() - 1)
  operand_text = rest[m.end():close - 1]
  operands = tuple(o.group(1) for o in re.finditer(r'%([^\s,()]+)', operand_text))
  attributes = rest[close:].lstrip(', ')
  return Instruction(name=name.lstrip('%'), shape=shape, opcode=opcode, operands=operands,
                     attributes=attributes, position=position)


def operand_arrays(computation: Computation, instruction: Instruction) -> tuple[Array, ...]:
  """The arrays of `instruction`'s operands (those defined in `computation`)."""
  by_name = computation.by_name()
  arrays = []
  for name in instruction.operands:
    if name in by_name:
      arrays.extend(by_name[name].arrays)
  return tuple(arrays)
