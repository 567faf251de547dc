"""Deprecated: `dos_jax.device_stream` is `dos_jax.step.device_stream` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import device_stream as _moved

warnings.warn('dos_jax.device_stream moved to dos_jax.step.device_stream; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
