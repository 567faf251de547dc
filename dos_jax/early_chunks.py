"""Deprecated: `dos_jax.early_chunks` is `dos_jax.step.early_chunks` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import early_chunks as _moved

warnings.warn('dos_jax.early_chunks moved to dos_jax.step.early_chunks; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
