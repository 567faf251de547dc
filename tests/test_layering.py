"""The package's layers: the library never imports the runner, the planner never imports
the runner, and no two modules import each other (imports inside functions included).

Read from the sources with `ast`: what a module could import, not what one run did.
"""

import ast
import pathlib

import dos_jax

_ROOT = pathlib.Path(dos_jax.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(_ROOT.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports() -> dict[str, set[str]]:
  graph = {}
  for path in _ROOT.rglob('*.py'):
    name = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        found.add(node.module)
        found.update(f'{node.module}.{a.name}' for a in node.names)
    graph[name] = {m for m in found if m.startswith('dos_jax')}
  modules = set(graph)
  return {name: {m for m in targets if m in modules and m != name}
          for name, targets in graph.items()}


def test_the_planner_and_the_library_never_import_the_runner():
  graph = _imports()
  offenders = [(a, b) for a, targets in graph.items() for b in targets
               if not a.startswith(('dos_jax.train', 'dos_jax.cli'))
               and b.startswith('dos_jax.train')]
  assert not offenders, offenders


def test_no_two_runner_modules_import_each_other():
  graph = _imports()
  pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                  if a in graph.get(b, set()) and a.startswith('dos_jax.train')})
  assert not pairs, pairs
