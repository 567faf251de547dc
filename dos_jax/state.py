"""Deprecated: `dos_jax.state` is `dos_jax.geometry.state` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.geometry import state as _moved

warnings.warn('dos_jax.state moved to dos_jax.geometry.state; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
