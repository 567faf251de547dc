"""Deprecated: `dos_jax.chunked` is `dos_jax.step.chunked` (this name goes in the next release)."""

import sys
import warnings

from dos_jax.step import chunked as _moved

warnings.warn('dos_jax.chunked moved to dos_jax.step.chunked; the old name goes in the next'
              ' release', DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
