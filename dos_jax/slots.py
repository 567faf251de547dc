"""Deprecated: `dos_jax.slots` is `dos_jax.geometry.slots` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.geometry import slots as _moved

warnings.warn('dos_jax.slots moved to dos_jax.geometry.slots; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
