"""transformers for the hf tests, with Hugging Face's `kernels` package ahead of this
repository's `kernels/` folder.

transformers >= 5 imports the `kernels` distribution where it is installed (its
`hub_kernels` integration). The repository's `kernels/` folder is installed as
`dos_jax.kernels`, but where the repository's root is on `sys.path` (pytest puts it
there for `tests/`) `import kernels` finds the folder first, and loading any model
fails in transformers with "cannot import name ... from 'kernels'". An installed
package is not affected: only a process whose path starts at this root.
"""

import importlib
import importlib.metadata
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_transformers():
  """`transformers`, or the test module skipped with the hf extra's reason; the
  `kernels` distribution, if installed, imported first from outside this root."""
  torch = pytest.importorskip('torch', reason='the hf tests need the `hf` extra (torch CPU)')
  try:
    importlib.metadata.distribution('kernels')
  except importlib.metadata.PackageNotFoundError:
    pass
  else:
    path = sys.path[:]
    sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != ROOT]
    try:
      importlib.import_module('kernels')
    finally:
      sys.path[:] = path
  transformers = pytest.importorskip(
      'transformers', reason='the hf tests need the `hf` extra (transformers)')
  return torch, transformers
