"""Deprecated: `dos_jax.tier_updates` is `dos_jax.step.tier_updates` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import tier_updates as _moved

warnings.warn('dos_jax.tier_updates moved to dos_jax.step.tier_updates; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
