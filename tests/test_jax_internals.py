"""The private JAX details dos_jax relies on are where `kernels/jax_internals.py` looks
for them: a jax that moves one fails here with a line naming it and its user."""

import jax

from dos_jax.kernels import jax_internals


def test_every_private_detail_is_where_the_seam_expects_it():
  assert jax_internals.problems() == [], '\n'.join(jax_internals.problems())


def test_no_other_module_reaches_into_jax_private_modules():
  """Only the seam imports `jax._src`: every other module of the package goes through
  it."""
  import pathlib  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).resolve().parent.parent
  offenders = []
  for path in [*(root / 'dos_jax').rglob('*.py'), *(root / 'kernels').glob('*.py')]:
    if path.name == 'jax_internals.py' or 'kernels' in path.parts[-2:-1] and path.is_symlink():
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split('#', 1)[0]
      if 'jax._src' in code and '`jax._src' not in code:  # code, not a docstring's name
        offenders.append(f'{path.relative_to(root)}:{number}: {line.strip()}')
  assert offenders == [], '\n'.join(offenders)


def test_the_seam_names_what_a_moved_detail_breaks(monkeypatch):
  """A detail gone from jax is one line naming it, the jax version and the user."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  monkeypatch.delattr(xla_bridge, '_backend_factories')
  found = jax_internals.problems()
  assert found == [f'jax {jax.__version__}: jax._src.xla_bridge._backend_factories is '
                   'gone; used by kernels._pjrt'], found
