"""Native AdamW on the host: the XLA:CPU custom call built from host_adamw.cc.

`adamw_host` has the semantics of `pallas_adamw.adamw_reference` and updates master,
m and v in place (`input_output_aliases`; under jit with donation no copy is made). It
runs on the CPU backend. The native library is compiled when the package is installed;
where it is missing or cannot be loaded, `host_kernel_available()` is False, the reason
is in `host_kernel_unavailable_reason()`, and callers fall back to XLA.
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.kernels import _native
from dos_jax.kernels import adamw_scalars
from dos_jax.kernels.adamw_scalars import AdamWScalars

_TARGET = 'dos_jax_adamw_host'
_TARGET_LOWP_IN = 'dos_jax_adamw_host_lowp_in'  # also takes a buffer for the lowp output


class HostIsa(enum.IntEnum):
  """Instruction set of the vectorized loop (values shared with host_adamw.cc)."""

  AUTO = 0  # the widest this CPU supports
  BASELINE = 1  # the compiler's default target (SSE2 on x86-64)
  AVX2 = 2  # AVX2 + FMA
  AVX512 = 3  # AVX-512 F/BW/VL/DQ


@functools.cache
def _load() -> tuple[Any, str]:
  """Imports the native module and registers its FFI targets; (module, '') or (None, why)."""
  return _native.load('_host_adamw',
                      {_TARGET: 'handler', _TARGET_LOWP_IN: 'handler_lowp_in'},
                      'native host AdamW')


def host_kernel_available() -> bool:
  """Whether the native host AdamW is built, loadable and registered with XLA:CPU."""
  return _load()[0] is not None


def host_kernel_unavailable_reason() -> str:
  """Why `host_kernel_available()` is False ('' when it is True)."""
  return _load()[1]


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


@functools.partial(jax.jit, static_argnames=('lowp_dtype', 'nesterov', 'num_threads', 'isa'))
def _adamw_call(packed, limit, master, mu, nu, grad, lowp_out, *, lowp_dtype, nesterov,
                num_threads, isa):
  reuse = lowp_out is not None
  call = jax.ffi.ffi_call(
      _TARGET_LOWP_IN if reuse else _TARGET,
      (
          jax.ShapeDtypeStruct(master.shape, master.dtype),
          jax.ShapeDtypeStruct(mu.shape, mu.dtype),
          jax.ShapeDtypeStruct(nu.shape, nu.dtype),
          # Zero elements (per subgroup) when no low-precision copy is wanted.
          jax.ShapeDtypeStruct(master.shape[:-1] + (0,) if lowp_dtype is None else
                               master.shape, lowp_dtype or jnp.float32),
      ),
      input_output_aliases={0: 0, 1: 1, 2: 2, **({6: 3} if reuse else {})},
      # Under vmap every argument gains the batch axis, the coefficients and the decay
      # limit included: the kernel then reads one set per subgroup.
      vmap_method='broadcast_all',
  )
  args = (master, mu, nu, grad, packed, limit) + ((lowp_out,) if reuse else ())
  out = call(*args, num_threads=np.int64(num_threads), nesterov=nesterov,
             isa=np.int64(isa))
  return (*out[:3], None if lowp_dtype is None else out[3])


def adamw_host(master, mu, nu, grad, scalars: AdamWScalars, *, decay_limit,
               lowp_dtype: Any, nesterov: bool = False, num_threads: int | None = None,
               isa: HostIsa = HostIsa.AUTO, lowp_out=None):
  """One AdamW step on a flat subgroup with the native, multi-threaded host kernel.

  Arguments and results as `adamw_pallas` (see there); in addition:

  Args:
    num_threads: threads to split the subgroup over (default: the cores available).
      Subgroups smaller than 32768 elements per thread use fewer threads.
    isa: instruction set of the loop; AUTO picks the widest the CPU supports. All give
      identical results.
    lowp_out: optional dead array of shape (S,) and dtype `lowp_dtype` (e.g. last
      step's low-precision params) to write the low-precision result into; donated
      under jit it spares XLA a fresh allocation every step.

  Raises:
    RuntimeError: the native library is missing (`host_kernel_available()` is False).
  """
  if not host_kernel_available():
    raise RuntimeError(host_kernel_unavailable_reason())
  adamw_scalars.check_inputs(master, mu, nu, grad, decay_limit, lowp_dtype, lowp_out)
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  limit = jnp.asarray(decay_limit, jnp.int32)
  return _adamw_call(packed, limit, master, mu, nu, grad, lowp_out,
                     lowp_dtype=None if lowp_dtype is None else jnp.dtype(lowp_dtype),
                     nesterov=nesterov,
                     num_threads=threads, isa=int(isa))
