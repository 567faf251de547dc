"""The package's layers, stated as data (`LAYERS`) and checked from the sources with
`ast`: what a module could import, not what one run did; imports inside functions
included. Every module of `dos_jax` (and of `dos_jax.kernels`, which lives in
kernels/) belongs to one layer, and imports only from its own layer and those below.

The layers, bottom to top:

* kernels  -- `dos_jax.kernels`: the Pallas and native host AdamW, their scalars and
              their registration in GPU plugins; with `dos_jax.cache`, the one cache
              directory, where the kernels keep their probe verdicts. They know nothing
              of the optimizer state.
* state    -- `dos_jax.geometry` (layout, slots, partition, state, disk_files: how a
              parameter tree becomes the offloaded state) with the values a step is
              configured by and the memories it runs in: policies, offload,
              implementation, compiler_options, memory_spaces, validate, meshes,
              pinned_pool, clipping, host_memory. Nothing here builds a step. The state layer knows a
              placement policy only as `policies.Policy` (and `policies.AdaptivePolicy`,
              one that re-plans as it runs), never the planner's `Auto`.
* step     -- `dos_jax.step` (transform, tier_updates, paths, adamw_hyperparams, kernel_calls,
              device_stream, construction, lanes, early_calls, ...) with what acts on a
              state with the step's machinery: capability, migration, state_ops,
              state_files, portable, alias. A jitted step is built from this layer and
              those below alone.
* planner  -- `dos_jax.planner`: the cost model and `Auto`, which choose the state layer's
              `Plan`s; `dos-jax plan`. With `dos_jax.model_shapes`, the transformer
              size presets that `dos-jax plan` and the runner read (the step never does).
* api      -- the package `dos_jax` itself (`__init__.py`): the public names, re-exported
              from the step layer and the planner. What users, and the layers above, import.
* dataflow -- `dos_jax.dataflow`: the GPU program seen without a GPU, read from lowered
              and compiled programs (graph, HLO, schedule), and compiling for a GPU
              target. The tests and the runner use it; no module of the step does.
* train    -- `dos_jax.train`: the pretraining runner. It reaches the library through
              `dos_jax` (api), the planner and dataflow, never a state, step or kernel module
              directly: what it needs from them is a public name.
* cli      -- `dos_jax.cli`: the `dos-jax` command, dispatching to train and planner.

No module imports another that imports it back, through any chain. A child process's
command line is not an import: `kernels._pjrt` runs `dos_jax.dataflow.kernel_probe`
as a program of its own, so that the kernels need not load the dataflow layer.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import dos_jax

# (layer, its modules), bottom to top. A name matches itself; 'P.*' matches the modules
# directly in package P. An exact name wins over a pattern.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ('kernels', ('dos_jax.kernels', 'dos_jax.kernels.*', 'dos_jax.cache')),
    ('state', ('dos_jax.geometry', 'dos_jax.geometry.*', 'dos_jax.policies', 'dos_jax.offload',
               'dos_jax.implementation', 'dos_jax.compiler_options', 'dos_jax.memory_spaces',
               'dos_jax.validate', 'dos_jax.meshes', 'dos_jax.lowering', 'dos_jax.pinned_pool',
               'dos_jax.clipping', 'dos_jax.host_memory')),
    ('step', ('dos_jax.*', 'dos_jax.step', 'dos_jax.step.*')),
    ('planner', ('dos_jax.planner', 'dos_jax.planner.*', 'dos_jax.model_shapes')),
    ('api', ('dos_jax',)),
    ('dataflow', ('dos_jax.dataflow', 'dos_jax.dataflow.*')),
    ('train', ('dos_jax.train', 'dos_jax.train.*')),
    ('cli', ('dos_jax.cli',)),
)

_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def _source_roots() -> dict[str, pathlib.Path]:
  """Package name -> directory: `dos_jax`, and `dos_jax.kernels` where it lies apart
  (kernels/ in the repository, installed as `dos_jax.kernels`)."""
  roots = {'dos_jax': pathlib.Path(dos_jax.__file__).parent.resolve()}
  spec = importlib.util.find_spec('dos_jax.kernels')
  for location in spec.submodule_search_locations or ():
    path = pathlib.Path(location).resolve()  # a checkout may link dos_jax/kernels there
    if roots['dos_jax'] not in path.parents:
      roots['dos_jax.kernels'] = path
  return roots


def _sources() -> dict[str, pathlib.Path]:
  """Every module of the package, by name."""
  modules = {}
  for package, root in _source_roots().items():
    for path in sorted(root.rglob('*.py')):
      parts = path.relative_to(root).with_suffix('').parts
      if parts[-1] == '__init__':
        parts = parts[:-1]
      modules['.'.join((package,) + parts)] = path
  return modules


def _target(name: str, modules) -> str | None:
  """The module an imported name is in: itself, or its longest prefix that is one."""
  while name and name not in modules:
    name = name.rpartition('.')[0]
  return name or None


def _imported(module: str, path: pathlib.Path, modules) -> set[str]:
  """The package's modules that `module` imports, at module level or inside functions.
  `from P import x` imports module `P.x` where there is one, else `P` (a name in it)."""
  package = module if path.name == '__init__.py' else module.rpartition('.')[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - (node.level - 1)]
        base = '.'.join(anchor + ([base] if base else []))
      names = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else base
               for alias in node.names]
    else:
      continue
    found.update(_target(n, modules) for n in names if n.split('.')[0] == 'dos_jax')
  return {m for m in found if m is not None and m != module}


def _graph() -> dict[str, set[str]]:
  modules = _sources()
  return {name: _imported(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str | None:
  """The layer `module` belongs to (see `LAYERS`), or None."""
  parent = module.rpartition('.')[0]
  exact = [layer for layer, names in LAYERS if module in names]
  pattern = [layer for layer, names in LAYERS if f'{parent}.*' in names]
  return (exact or pattern or [None])[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_layer():
  graph = _graph()
  assert {'dos_jax', 'dos_jax.step.transform', 'dos_jax.kernels.host_adamw_rows',
          'dos_jax.planner.auto', 'dos_jax.dataflow.schedule', 'dos_jax.train.loop',
          'dos_jax.cli'} <= set(graph)
  unplaced = sorted(m for m in graph if _layer(m) is None)
  assert not unplaced, f'place these modules in a layer of LAYERS: {unplaced}'


def test_imports_go_down_the_layers():
  """A module imports from its own layer and those below, never from above."""
  graph = _graph()
  upward = sorted(f'{a} ({_layer(a)}) -> {b} ({_layer(b)})'
                  for a, targets in graph.items() for b in targets
                  if _RANK[_layer(b)] > _RANK[_layer(a)])
  assert not upward, '\n'.join(['imports up the layers:'] + upward)


def test_the_core_knows_neither_the_planner_nor_the_dataflow_readers():
  """The step's modules do not import `Auto` (a policy says whether it re-plans) nor
  any reader of HLO: both sit above the state and step layers."""
  graph = _graph()
  below = {'kernels', 'state', 'step'}
  offenders = sorted((a, b) for a, targets in graph.items() for b in targets
                     if _layer(a) in below
                     and b.startswith(('dos_jax.planner', 'dos_jax.dataflow')))
  assert not offenders, offenders


def test_the_runner_reaches_the_core_only_through_the_public_api():
  graph = _graph()
  into_core = sorted((a, b) for a, targets in graph.items() for b in targets
                     if _layer(a) == 'train' and _layer(b) in ('kernels', 'state', 'step'))
  assert not into_core, (f'the runner imports state or step modules past the public dos_jax: '
                         f'{into_core}; import the public name from dos_jax instead')


def test_no_import_cycles():
  cycles = _cycles(_graph())
  assert not cycles, cycles


def test_the_planner_and_the_library_never_import_the_runner():
  graph = _graph()
  offenders = [(a, b) for a, targets in graph.items() for b in targets
               if not a.startswith(('dos_jax.train', 'dos_jax.cli'))
               and b.startswith('dos_jax.train')]
  assert not offenders, offenders


def test_no_two_runner_modules_import_each_other():
  graph = _graph()
  pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                  if a in graph.get(b, set()) and a.startswith('dos_jax.train')})
  assert not pairs, pairs


def test_the_graph_reads_both_kinds_of_import():
  """The parser sees module-level and function-level imports, and `from P import m`
  as module `P.m` (else every `from dos_jax import x` would look like the api)."""
  graph = _graph()
  assert 'dos_jax.geometry.slots' in graph['dos_jax.step.paths']  # `from dos_jax.geometry import slots`
  assert 'dos_jax.geometry.layout' in graph['dos_jax.step.tier_updates']
  # `from dos_jax.geometry.partition import Piece`: the module, not a module named Piece
  assert 'dos_jax.geometry.partition' in graph['dos_jax.geometry.columns']
  assert 'dos_jax.kernels.pallas_adamw' in graph['dos_jax.step.kernel_calls']  # inside a function
  assert 'dos_jax' not in graph['dos_jax.step.paths']
  assert 'dos_jax' in graph['dos_jax.train.step']  # `import dos_jax`
  assert 'dos_jax.kernels.host_adamw_rows' in graph['dos_jax.dataflow.compile']



def _programs_named(path: pathlib.Path, modules) -> set[str]:
  """The package's modules a source runs as a program of their own, named in a string
  (`kernels._pjrt` runs `from dos_jax.dataflow import kernel_probe; kernel_probe.main(...)`
  in a child process, `python -m dos_jax.X`)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      for base, name in re.findall(r'from (dos_jax[\w.]*) import (\w+)', node.value):
        found.add(_target(f'{base}.{name}', modules))
      found.update(_target(m, modules) for m in re.findall(r'-m (dos_jax[\w.]*)', node.value))
  return found - {None}


def _documented(modules) -> set[str]:
  """The modules docs/ names as public API (`dos_jax.kernels.host_adamw8.adamw8_host`)."""
  docs = pathlib.Path(__file__).resolve().parents[1] / 'docs'
  names = re.findall(r'`(dos_jax(?:\.\w+)+)', ' '.join(p.read_text() for p in docs.glob('*.md')))
  return {_target(n, modules) for n in names} - {None}


def test_every_module_is_the_products():
  """Only the product is installed: every module is reached from the public API
  (`dos_jax`, the modules docs/ names) or the `dos-jax` command (`dos_jax.cli`), by an
  import or run as a program, with the packages above it. Verification tooling lives
  in tests/tooling, outside the package."""
  modules = _sources()
  graph = _graph()
  edges = {name: graph[name] | _programs_named(path, modules) for name, path in modules.items()}
  reached, todo = set(), ['dos_jax', 'dos_jax.cli'] + sorted(_documented(modules))
  while todo:
    name = todo.pop()
    if name not in reached:
      reached.add(name)
      todo.extend(edges.get(name, ()))
      todo.extend(name.rsplit('.', k)[0] for k in range(1, name.count('.') + 1))
  unused = sorted(set(modules) - reached)
  assert not unused, (f'modules no product code reaches (move tooling to tests/tooling, or '
                      f'import it from the product): {unused}')
