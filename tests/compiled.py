"""What the compiled-for-GPU test files share: skip where no GPU program can be compiled."""

import jax
import pytest

from dos_jax import dataflow


def skip_without_gpu_compiler() -> None:
  """Skips the calling module where the CUDA plugin is missing or a GPU is present (a
  GPU machine compiles for its own GPU elsewhere; deviceless compiles need
  `JAX_PLATFORMS=cpu`)."""
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}', allow_module_level=True)
  if jax.default_backend() != 'cpu':
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu', allow_module_level=True)
