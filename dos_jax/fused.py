"""Deprecated: `dos_jax.fused` is `dos_jax.step.fused` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import fused as _moved

warnings.warn('dos_jax.fused moved to dos_jax.step.fused; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
