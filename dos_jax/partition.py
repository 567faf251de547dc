"""Deprecated: `dos_jax.partition` is `dos_jax.geometry.partition` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.geometry import partition as _moved

warnings.warn('dos_jax.partition moved to dos_jax.geometry.partition; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
