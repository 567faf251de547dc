"""YAML -> frozen dataclasses, by reflection, with errors that name the key.

The run config is a tree of frozen dataclasses (`dos_jax.train.config`). This module
knows nothing about training: it walks a dataclass's fields and their type hints,
converts plain YAML values (mappings, lists, scalars) into them, and rejects unknown
keys and ill-typed values with the dotted key path, e.g.
`configs/tiny.yaml: optim.lr: expected a positive float, got 'abc'`.

Each default lives in one place, the dataclass; a YAML file only overrides. Fields may
carry `metadata={'check': Check(...)}` for value constraints that a type cannot say;
cross-field constraints belong in `__post_init__`, raising `ValueError('key: ...')`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar

import yaml

T = TypeVar('T')


class ConfigError(ValueError):
  """A mistake in a user's config; `str(err)` is the one line to show them."""


@dataclasses.dataclass(frozen=True)
class Check:
  """A value constraint on a config field, named by an adjective for the error line.

  `Check('positive', lambda v: v > 0)` on a float field reads
  "expected a positive float, got -1.0".
  """

  adjective: str
  ok: Callable[[Any], bool]


POSITIVE = Check('positive', lambda v: v > 0)
NON_NEGATIVE = Check('non-negative', lambda v: v >= 0)
UNIT_INTERVAL = Check('in [0, 1]', lambda v: 0.0 <= v <= 1.0)
OPEN_UNIT_INTERVAL = Check('in [0, 1)', lambda v: 0.0 <= v < 1.0)
NON_EMPTY = Check('non-empty', lambda v: len(v) > 0)


def field(default: Any = dataclasses.MISSING, *, check: Check | None = None, **kwargs):
  """`dataclasses.field` with an optional `check` stored in its metadata."""
  metadata = dict(kwargs.pop('metadata', {}) or {})
  if check is not None:
    metadata['check'] = check
  return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _type_name(tp: Any) -> str:
  if tp is type(None):
    return 'null'
  if tp is int:
    return 'integer'
  if tp is str:
    return 'string'
  if isinstance(tp, type):
    return tp.__name__
  return str(tp).replace('typing.', '')


def _describe(tp: Any, check: Check | None) -> str:
  """'a positive float', 'an integer', "one of 'a', 'b'": what the error line expects."""
  if typing.get_origin(tp) is Literal:
    return 'one of ' + ', '.join(repr(c) for c in typing.get_args(tp))
  name = _type_name(tp)
  if check is None:
    return f'a{"n" if name[0] in "aeiou" else ""} {name}'
  if check.adjective.startswith('in '):
    return f'a {name} {check.adjective}'
  return f'a{"n" if check.adjective[0] in "aeiou" else ""} {check.adjective} {name}'


def _convert(tp: Any, value: Any, key: str, check: Check | None = None) -> Any:
  """Converts a plain YAML value to type `tp`; raises ConfigError naming `key`."""
  origin = typing.get_origin(tp)

  def fail(expected: str):
    raise ConfigError(f'{key}: expected {expected}, got {value!r}')

  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    non_null = [a for a in args if a is not type(None)]
    if len(non_null) == 1:
      try:
        return _convert(non_null[0], value, key, check)
      except ConfigError:
        # An optional section keeps its own error, which names the key inside it.
        if type(None) in args and not dataclasses.is_dataclass(non_null[0]):
          fail(f'{_describe(non_null[0], check)} or null')
        raise
    for arg in non_null:
      try:
        return _convert(arg, value, key, check)
      except ConfigError:
        continue
    fail(' or '.join(_describe(a, check) for a in args))

  if origin is Literal:
    choices = typing.get_args(tp)
    if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
      fail(_describe(tp, None))
    return value

  if origin in (tuple, list):
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      fail('a list')
    item_tp = args[0] if args else Any
    return tuple(_convert(item_tp, v, f'{key}[{i}]') for i, v in enumerate(value))

  if dataclasses.is_dataclass(tp):
    return from_dict(tp, value, key=key)

  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    try:
      return tp(value)
    except ValueError:
      fail('one of ' + ', '.join(repr(m.value) for m in tp))

  if tp is Any:
    return value

  if tp is bool:
    if not isinstance(value, bool):
      fail('true or false')
    converted = value
  elif tp is int:
    converted = _as_number(value)
    if converted is None or not float(converted).is_integer():
      fail(_describe(int, check))
    converted = int(converted)
  elif tp is float:
    converted = _as_number(value)
    if converted is None or not math.isfinite(converted):
      fail(_describe(float, check))
    converted = float(converted)
  elif tp is str:
    if not isinstance(value, str):
      fail(_describe(str, check))
    converted = value
  else:
    raise TypeError(f'{key}: config fields of type {tp!r} are not supported')

  if check is not None and not check.ok(converted):
    fail(_describe(tp, check))
  return converted


def _as_number(value: Any) -> float | int | None:
  """Ints and floats pass; numeric strings too, because YAML 1.1 reads `3e-3` as a string."""
  if isinstance(value, bool):
    return None
  if isinstance(value, (int, float)):
    return value
  if isinstance(value, str):
    try:
      return int(value) if value.strip().lstrip('+-').isdigit() else float(value)
    except ValueError:
      return None
  return None


def from_dict(cls: type[T], data: Any, *, key: str = '') -> T:
  """Builds dataclass `cls` from a mapping; missing keys take the dataclass defaults."""
  prefix = f'{key}.' if key else ''
  if data is None:
    data = {}
  if not isinstance(data, Mapping):
    raise ConfigError(f'{key or "config"}: expected a mapping of keys, got {data!r}')
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = [k for k in data if k not in fields]
  if unknown:
    raise ConfigError(
        f'{prefix}{unknown[0]}: unknown key; known keys here: {", ".join(fields)}'
    )
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in data.items():
    if dataclasses.is_dataclass(hints[name]) and isinstance(value, Mapping):
      value = _over_default(fields[name], value)
    kwargs[name] = _convert(hints[name], value, prefix + name, fields[name].metadata.get('check'))
  missing = [
      name for name, f in fields.items()
      if name not in kwargs
      and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
  ]
  if missing:
    raise ConfigError(f'{prefix}{missing[0]}: required key is missing')
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except (ValueError, TypeError) as err:
    # __post_init__ names the field it rejects ("lr: ..."); else blame the section.
    message = str(err)
    # Sections written elsewhere may say "ModelConfig.dim must be ..." or "ModelConfig: ...".
    for lead in (f'{cls.__name__}.', f'{cls.__name__}: '):
      if message.startswith(lead):
        message = message[len(lead):]
    head = message.split(':', 1)[0].split(' ', 1)[0].strip()
    if head in fields or head.split('.', 1)[0] in fields:
      rest = message[len(head):].lstrip(':').strip()
      raise ConfigError(f'{prefix}{head}: {rest}') from None
    raise ConfigError(f'{key}: {message}' if key else message) from None


def _over_default(f: dataclasses.Field, value: Mapping) -> dict:
  """A section's YAML keys laid over the section's own default (e.g. the run's default
  model preset), so a file that sets `model.remat` keeps the default model."""
  if f.default_factory is not dataclasses.MISSING:
    base = f.default_factory()
  elif f.default is not dataclasses.MISSING:
    base = f.default
  else:
    return dict(value)
  merged = to_dict(base)
  for k, v in value.items():
    if isinstance(v, Mapping) and isinstance(merged.get(k), dict):
      v = {**merged[k], **v}
    merged[k] = v
  return merged


def to_dict(cfg: Any) -> Any:
  """The inverse of `from_dict` for writing a resolved config back as YAML."""
  if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
  if isinstance(cfg, enum.Enum):
    return cfg.value
  if isinstance(cfg, tuple):
    return [to_dict(v) for v in cfg]
  return cfg


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
  """`'optim.lr=1e-3'` -> `(('optim', 'lr'), 0.001)`; the value is read as YAML."""
  name, sep, raw = text.partition('=')
  name = name.strip()
  if not sep or not name or any(not part for part in name.split('.')):
    raise ConfigError(
        f'--set {text}: expected KEY=VALUE with no spaces around =, e.g.'
        f' --set {name or "optim.lr"}={"VALUE" if name else "1e-3"}'
    )
  try:
    value = yaml.safe_load(raw) if raw.strip() else None
  except yaml.YAMLError:
    raise ConfigError(f'--set {name}: cannot read {raw!r} as a YAML value') from None
  return tuple(name.split('.')), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
  """Returns a copy of `data` with each `a.b=c` override set (unknown keys fail later)."""
  data = _deep_copy(data)
  for text in overrides:
    path, value = parse_override(text)
    node = data
    for i, part in enumerate(path[:-1]):
      child = node.get(part)
      if child is None:
        child = node[part] = {}
      elif not isinstance(child, dict):
        raise ConfigError(f'--set {".".join(path)}: {".".join(path[:i + 1])} is not a section')
      node = child
    node[path[-1]] = value
  return data


def _deep_copy(data: Any) -> Any:
  if isinstance(data, dict):
    return {k: _deep_copy(v) for k, v in data.items()}
  return data


class _UniqueKeyLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
  """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last,
  silently dropping a whole section written earlier)."""

  def construct_mapping(self, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      try:
        first = seen.setdefault(key, key_node.start_mark.line + 1)
      except TypeError:
        continue  # An unhashable key: SafeLoader's own error says so.
      if first != key_node.start_mark.line + 1:
        raise DuplicateKey(key, key_node.start_mark.line + 1, first)
    return super().construct_mapping(node, deep=deep)


class DuplicateKey(Exception):
  def __init__(self, key, line: int, first: int):
    super().__init__(key, line, first)
    self.key, self.line, self.first = key, line, first


def read_yaml(text: str, source: str) -> dict:
  """Parses a YAML document that must be a mapping (or empty); errors name `source`.
  A key repeated in one mapping is an error (naming the key and both lines)."""
  try:
    data = yaml.load(text, Loader=_UniqueKeyLoader)  # A SafeLoader: no arbitrary objects.
  except DuplicateKey as err:
    raise ConfigError(
        f'{source}: duplicate key {err.key!r} (line {err.line}; first given on line'
        f' {err.first})'
    ) from None
  except yaml.YAMLError as err:
    raise ConfigError(f'{source}: not valid YAML{_yaml_where(err, text)}') from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f'{source}: expected a mapping of config sections, got {data!r}')
  return data


def _yaml_where(err: yaml.YAMLError, text: str) -> str:
  """' (line N: what)' for a YAML error, N counted from 1 in `text`. An error found at
  the end of the file (an unclosed `[`, `{` or quote) is reported where the unclosed
  construct starts, not on the line after the last one, where PyYAML puts it."""
  mark = getattr(err, 'problem_mark', None)
  if mark is None:
    return ''
  problem = (getattr(err, 'problem', None) or '').strip()
  context = (getattr(err, 'context', None) or '').strip()
  context_mark = getattr(err, 'context_mark', None)
  if mark.index >= len(text.rstrip()) and context_mark is not None:
    line = (text.splitlines() or [''])[min(context_mark.line, len(text.splitlines()) - 1)]
    opener = line[context_mark.column:context_mark.column + 1]
    what = (f'{opener!r} is never closed' if opener in ('[', '{', '"', "'")
            else f'{context.removeprefix("while ") or "this"} is never closed')
    return f' (line {context_mark.line + 1}: {what})'
  lines = max(1, len(text.splitlines()))
  return f' (line {min(mark.line + 1, lines)}{": " + problem if problem else ""})'


def describe_fields(cls: type, choices: Mapping[str, Sequence[Any]] | None = None
                    ) -> list[tuple[str, str]]:
  """(dotted key, "default  (accepts: ...)") for every leaf of `cls`'s default
  instance, for `--help`. What a key accepts is read from its type hint and check
  ("an integer", "one of 'a', 'b'", "'auto' or an integer"); `choices` names the values
  of keys whose type is a plain str checked elsewhere (e.g. `model.attention`)."""
  choices = dict(choices or {})
  rows = []

  def walk(node, prefix):
    for k, v in node.items():
      dotted = f'{prefix}{k}'
      if isinstance(v, dict) and dotted not in choices and _field(cls, dotted)[0] is not dict:
        walk(v, f'{dotted}.')
        continue
      rows.append((dotted, f'{v!r}  (accepts: {accepts(cls, dotted, choices.get(dotted))})'))

  walk(to_dict(from_dict(cls, {})), '')
  return rows


def _field(cls: type, dotted: str) -> tuple[Any, Check | None]:
  """The type hint and check of the field at `dotted` (Any, None where unknown)."""
  tp: Any = cls
  check = None
  for part in dotted.split('.'):
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    inner = [a for a in args if dataclasses.is_dataclass(a)]
    tp = inner[0] if inner else tp
    if not dataclasses.is_dataclass(tp):
      return Any, None
    fields = {f.name: f for f in dataclasses.fields(tp)}
    check = fields[part].metadata.get('check') if part in fields else None
    tp = typing.get_type_hints(tp).get(part, Any)
  return tp, check


def accepts(cls: type, dotted: str, values: Sequence[Any] | None = None) -> str:
  """What the key at `dotted` of `cls` accepts, in words: "an integer", "one of 'a',
  'b'", "'auto' or an integer or a list of integers", "a float or null"."""
  tp, check = _field(cls, dotted)
  args = (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType)
          else (tp,))
  parts = []
  for arg in args:
    if arg is type(None):
      continue
    if values is not None and arg is str:
      parts.append('one of ' + ', '.join(repr(v) for v in values))
    elif typing.get_origin(arg) is Literal and len(typing.get_args(arg)) == 1:
      parts.append(repr(typing.get_args(arg)[0]))
    elif typing.get_origin(arg) in (tuple, list):
      item = (typing.get_args(arg) or (Any,))[0]
      parts.append('a list of ' + ('values' if item is Any else
                                   _plural(_describe(item, None))))
    elif dataclasses.is_dataclass(arg):
      parts.append('a mapping of ' + ', '.join(f.name for f in dataclasses.fields(arg)))
    elif isinstance(arg, type) and issubclass(arg, enum.Enum):
      parts.append('one of ' + ', '.join(repr(m.value) for m in arg))
    elif arg is bool:
      parts.append('true or false')
    elif arg is Any:
      parts.append('any value')
    else:
      parts.append(_describe(arg, check))
  if type(None) in args:
    parts.append('null')
  return ' or '.join(parts)


def _plural(described: str) -> str:
  """'an integer' -> 'integers'; "one of 'a', 'b'" stays."""
  for article in ('an ', 'a '):
    if described.startswith(article):
      return described[len(article):] + 's'
  return described
