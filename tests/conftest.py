"""Test set-up: 8 virtual CPU devices for the sharding tests, and the `gpu` marker."""

import os

# Must happen before JAX starts a backend. Tests that do not shard use device 0 only.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == 'gpu':
    return
  skip_gpu = pytest.mark.skip(reason='needs a CUDA GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip_gpu)
