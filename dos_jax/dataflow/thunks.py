"""What a compiled GPU program runs, thunk by thunk: which CUDA stream each step of it
is on, and which steps run one after another.

XLA:GPU turns the scheduled HLO into a sequence of *thunks* (a kernel launch, a copy, an
asynchronous start or done...), which is what a GPU executes. With `xla_dump_to` set,
the compiler writes it as `<module>.thunk_sequence.txt` (one line per thunk; the thunks
an asynchronous start runs on its stream are indented under it) and
`<module>.thunk_metadata.txt` (each thunk's id and the HLO instruction it comes from).
`dataflow.compile_for_gpu(..., thunks=True)` keeps both (`CompiledGpuProgram.thunks`).

What the reader shows that the schedule cannot: a stream region
(`dos_jax.step.device_stream`) runs its instructions one after another on its stream,
its copies between host and device memory included. XLA 0.11's stream assignment
(`ExecutionStreamAssignment`) does not walk into the computation of an asynchronous
call, so a `copy-start` there has no stream of its own and is emitted as a synchronous
copy (`EmitCopyStartThunk`), and an asynchronous `dynamic-slice` there has none at all
("No ExecutionStreamId found"). Two transfers in one region never overlap, whatever the
schedule says.

>>> text = '''001: kAsyncStart [source | sink] stream=computation_stream[1], async_id=1
...     002: kCopy [source | sink] (no description)
...     003: kCopy [source | sink] (no description)
... 004: kAsyncDone [source | sink] async_id=1'''
>>> names = {1: 'call-start', 2: 'copy-start.1', 3: 'copy-start.2', 4: 'call-done'}
>>> program = ThunkProgram.parse(text, names)
>>> program.runs_on('copy-start.2')
Placement(stream=1, region='call-start')
>>> program.one_after_another('copy-start.1', 'copy-start.2')
True
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_LINE = re.compile(r'^(?P<indent>\s*)(?P<id>\d+): (?P<kind>k\w+)\s*(?P<rest>.*)$')
_STREAM = re.compile(r'stream=\w*?_stream\[(\d+)\]')
_METADATA = re.compile(
    r'thunk_info \{\s*(?:profile_annotation: "(?P<name>[^"]*)"\s*)?(?:thunk_id: (?P<id>\d+)\s*)?\}',
    re.S)


@dataclasses.dataclass(frozen=True)
class Thunk:
  """One thunk: its id, kind (`kCopy`, `kAsyncStart`...), the HLO instruction it comes
  from, the stream an asynchronous start runs on, and the thunks it runs there."""

  id: int
  kind: str
  name: str
  stream: int | None = None
  nested: tuple['Thunk', ...] = ()


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where an instruction's thunk runs: on execution stream `stream` (None: the
  program's own stream, where synchronous thunks run), inside the stream region
  started by `region` (None: at the top level or in a loop, or as an asynchronous
  operation of its own on `stream`). A stream runs its work in issue order."""

  stream: int | None
  region: str | None


@dataclasses.dataclass(frozen=True)
class ThunkProgram:
  """The top-level thunks of one compiled program (see the module docstring)."""

  thunks: tuple[Thunk, ...]

  @classmethod
  def parse(cls, sequence: str, names: dict[int, str]) -> 'ThunkProgram':
    """From a `thunk_sequence.txt` text and {thunk id: HLO instruction name}. A thunk
    indented under another runs inside it (an asynchronous start's work, a loop's
    condition and body)."""
    root: list[tuple[int, Thunk, list]] = []  # (indent, thunk, children) trees
    stack: list[tuple[int, Thunk, list]] = []
    for line in sequence.splitlines():
      m = _LINE.match(line)
      if m is None:
        continue  # 'condition:', 'body:' labels
      indent = len(m.group('indent'))
      stream = _STREAM.search(m.group('rest'))
      node = (indent, Thunk(id=int(m.group('id')), kind=m.group('kind'),
                            name=names.get(int(m.group('id')), ''),
                            stream=int(stream.group(1)) if stream else None), [])
      while stack and stack[-1][0] >= indent:
        stack.pop()
      (stack[-1][2] if stack else root).append(node)
      stack.append(node)

    def build(node) -> Thunk:
      _, thunk, children = node
      return dataclasses.replace(thunk, nested=tuple(build(c) for c in children))

    return cls(thunks=tuple(build(n) for n in root))

  @classmethod
  def from_dump(cls, directory: str | pathlib.Path, module: str | None = None) -> 'ThunkProgram':
    """From an `xla_dump_to` directory: the module named `module` (a substring of its
    file name), or the one with the longest thunk sequence."""
    directory = pathlib.Path(directory)
    sequences = sorted(directory.glob('*.thunk_sequence.txt'))
    if module is not None:
      sequences = [p for p in sequences if module in p.name]
    if not sequences:
      raise FileNotFoundError(f'no thunk sequence in {directory} (was xla_dump_to set?)')
    sequence = max(sequences, key=lambda p: p.stat().st_size)
    metadata = sequence.with_name(sequence.name.replace('thunk_sequence', 'thunk_metadata'))
    return cls.parse(sequence.read_text(), parse_names(metadata.read_text()))

  def regions(self) -> tuple[Thunk, ...]:
    """Stream regions: the asynchronous calls (`call-start`) at the top level, each
    running the thunks of its computation on its stream."""
    return tuple(t for t in self.thunks
                 if t.kind == 'kAsyncStart' and t.name.startswith('call-start'))

  def runs_on(self, name: str) -> Placement | None:
    """Where instruction `name` runs (None: no thunk of that name)."""

    def find(thunks, stream, region):
      for thunk in thunks:
        if thunk.name == name:
          own = thunk.kind == 'kAsyncStart' and thunk.stream is not None
          return Placement(stream=thunk.stream if own else stream,
                           region=None if own else region)
        inner_stream, inner_region = stream, region
        if thunk.kind == 'kAsyncStart' and thunk.stream is not None:
          inner_stream, inner_region = thunk.stream, thunk.name
        found = find(thunk.nested, inner_stream, inner_region)
        if found is not None:
          return found
      return None

    return find(self.thunks, None, None)

  def one_after_another(self, first: str, second: str) -> bool:
    """Whether instructions `first` and `second` run on one CUDA stream (inside one
    region, or as work a stream carries in issue order), so never at the same time."""
    a, b = self.runs_on(first), self.runs_on(second)
    return a is not None and b is not None and a.stream == b.stream


def parse_names(metadata: str) -> dict[int, str]:
  """{thunk id: HLO instruction name} from a `thunk_metadata.txt` text."""
  names = {}
  for m in _METADATA.finditer(metadata):
    if m.group('id') is not None and m.group('name') is not None:
      names[int(m.group('id'))] = m.group('name')
  return names
