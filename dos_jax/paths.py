"""Deprecated: `dos_jax.paths` is `dos_jax.step.paths` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import paths as _moved

warnings.warn('dos_jax.paths moved to dos_jax.step.paths; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
