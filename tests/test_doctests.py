"""The docstring examples of the public entry points (`dos_jax.adamw`, `dos_jax.chain`,
`dos_jax.clip_by_global_norm`, `dos_jax.migrate`, `dos_jax.Implementation`,
`StepOptions`, `dos_jax.step.device_stream`'s region, `construction.stream_regions`, the
early host calls' rule and order (`partition.early_host_calls`,
`early_calls.host_blocks`), the thunk reader `dos_jax.dataflow.thunks`,
`dos_jax.dataflow.compile_step`, `dos_jax.state_to_files` and the runner's
`compile_cache`, run-folder lock, trackers and step trace, `AdamWHyperparams`,
`memory_spaces.host_region`) run as doctests, on the CPU backend, as CI runs them. Each
example compares with optax (stated tolerance) or prints exact values."""

import doctest

import pytest

from dos_jax import alias
from dos_jax import clipping
from dos_jax import implementation
from dos_jax import lowering
from dos_jax import memory_spaces
from dos_jax import migration
from dos_jax import state_files
from dos_jax.dataflow import early_windows
from dos_jax.dataflow import thunks
from dos_jax.geometry import columns
from dos_jax.geometry import partition
from dos_jax.step import adamw_hyperparams
from dos_jax.step import construction
from dos_jax.step import device_stream
from dos_jax.step import early_calls
from dos_jax.step import options
from dos_jax.train import compile_cache
from dos_jax.train import rundir
from dos_jax.train import step_trace
from dos_jax.train import trackers


@pytest.mark.parametrize('module', [alias, clipping, device_stream, thunks, early_windows,
                                    construction, migration, partition, columns, early_calls,
                                    compile_cache, state_files, rundir, trackers, step_trace,
                                    adamw_hyperparams, memory_spaces, implementation,
                                    options, lowering],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f'{module.__name__} has no docstring example'
  assert result.failed == 0, f'{result.failed} of {result.attempted} examples failed (above)'
