"""Deprecated: `dos_jax.layout` is `dos_jax.geometry.layout` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.geometry import layout as _moved

warnings.warn('dos_jax.layout moved to dos_jax.geometry.layout; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
