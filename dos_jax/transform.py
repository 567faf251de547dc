"""Deprecated: `dos_jax.transform` is `dos_jax.step.transform` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import transform as _moved

warnings.warn('dos_jax.transform moved to dos_jax.step.transform; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
