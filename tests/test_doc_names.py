"""Every `dos_jax.<name>` the docs, the README and the package's own docstrings and
comments name in backticks exists: a renamed or removed name leaves no trace in what a
reader follows (a module, a public name, an attribute, a dataclass field)."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _texts() -> dict[str, str]:
  paths = [*sorted((ROOT / 'docs').glob('*.md')), ROOT / 'README.md', ROOT / 'CONTRIBUTING.md',
           *sorted((ROOT / 'dos_jax').rglob('*.py')), *sorted((ROOT / 'kernels').glob('*.py'))]
  return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def _exists(name: str) -> bool:
  """Whether dotted `name` is a module, or an attribute chain from the longest module
  prefix (a dataclass field or an annotated class attribute counts)."""
  parts = name.split('.')
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module('.'.join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if hasattr(obj, attr):
        obj = getattr(obj, attr)
      elif ((dataclasses.is_dataclass(obj)
             and attr in {f.name for f in dataclasses.fields(obj)})
            or attr in getattr(obj, '__annotations__', {})):
        return True
      else:
        return False
    return True
  return False


def test_every_name_the_docs_give_exists():
  missing = {}
  for path, text in _texts().items():
    for name in re.findall(r'`(dos_jax(?:\.\w+)+)', text):
      if not _exists(name):
        missing.setdefault(name, []).append(path)
  assert not missing, '\n'.join(f'{name}: named in {", ".join(sorted(set(paths)))}'
                                for name, paths in sorted(missing.items()))


def test_a_removed_name_is_found():
  assert _exists('dos_jax.Offload.disk') and _exists('dos_jax.step.lanes')
  assert _exists('dos_jax.lowering.Lowering.STAGED')
  assert not _exists('dos_jax.Schedule') and not _exists('dos_jax.Offload.storage')
