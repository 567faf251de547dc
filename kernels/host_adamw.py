"""The native host AdamW's settings: the instruction set of its loop, its threads,
and the dtypes it reads and writes.

The kernel itself is `host_adamw_rows` (host_adamw_rows.cc). Its loop is compiled for
each instruction set `HostIsa` names and picks the widest this CPU supports unless a
call asks for one; `supported_isas()` says which this CPU has, from the same function
the kernel resolves its `isa` argument with (host_isa.cc, adamw_common.h).
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Any

import jax.numpy as jnp

from dos_jax.kernels import _native

# The dtypes both native host AdamWs read gradients in, and write parameters in.
GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LOWP_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class HostIsa(enum.IntEnum):
  """Instruction set of the vectorized loop (values shared with adamw_common.h)."""

  AUTO = 0  # the widest this CPU supports
  BASELINE = 1  # the compiler's default target (SSE2 on x86-64)
  AVX2 = 2  # AVX2 + FMA
  AVX512 = 3  # AVX-512 F/BW/VL/DQ


@functools.cache
def _load() -> tuple[Any, str]:
  """Imports the native instruction-set probe; (module, '') or (None, why)."""
  return _native.load('_host_isa', {}, 'native host AdamW instruction-set probe')


def supported_isas() -> tuple[HostIsa, ...]:
  """The instruction sets this CPU can run the loop with (empty without the library)."""
  module = _load()[0]
  if module is None:
    return ()
  mask = module.isa_mask()
  return tuple(isa for isa in HostIsa if isa != HostIsa.AUTO and (mask >> isa) & 1)


def default_num_threads() -> int:
  """The cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def check_threads_and_isa(num_threads: int | None, isa: HostIsa) -> tuple[int, HostIsa]:
  """The thread count (default: the cores available) and ISA of a native call.

  Raises:
    ValueError: `num_threads` is not a positive int, or this CPU lacks `isa`.
  """
  threads = default_num_threads() if num_threads is None else num_threads
  if not isinstance(threads, int) or threads < 1:
    raise ValueError(f'num_threads must be a positive int, got {num_threads!r}')
  isa = HostIsa(isa)
  if isa != HostIsa.AUTO and isa not in supported_isas():
    raise ValueError(f'isa={isa.name} is not supported by this CPU; '
                     f'supported: {[i.name for i in supported_isas()]}')
  return threads, isa
