"""The docstring examples of the public entry points (`dos_jax.adamw`, `dos_jax.chain`,
`dos_jax.clip_by_global_norm`, `dos_jax.step.device_stream`'s region, `dos_jax.stream_regions`, the thunk
reader `dos_jax.dataflow.thunks` and `dos_jax.dataflow.compile_step`) run as doctests, on the CPU backend, as CI runs them.
Each example compares with optax (stated tolerance) or prints exact values."""

import doctest

import pytest

from dos_jax import alias
from dos_jax import clipping
from dos_jax.dataflow import early_windows
from dos_jax.dataflow import thunks
from dos_jax.step import chunked
from dos_jax.step import device_stream
from dos_jax.step import construction


@pytest.mark.parametrize('module', [alias, chunked, clipping, device_stream, thunks,
                                    early_windows, construction],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f'{module.__name__} has no docstring example'
  assert result.failed == 0, f'{result.failed} of {result.attempted} examples failed (above)'
