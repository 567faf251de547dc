"""Whether an AdamW kernel can run a step's rows: one decision, with its reason.

A step of `dos_jax.adamw` may hand its rows to one of two kernels in place of XLA's
element-wise ops (`Kernel`): the native host AdamW or the Pallas AdamW. Whether it can
is decided here only, from the transform, the state's layout, the gradients and the
program, and comes back as one `Capability`: usable or not, and why not. The implementation the user asked for
(`Implementation.host`, `Implementation.device`) is the caller's to combine with it: a
kernel is used where it is asked for and usable.

The conditions are checked in a fixed order and the first that fails is the reason;
the native library is loaded (`kernels.host_adamw_rows.rows_kernel_available`) and
the GPU plugin asked (`host_kernel_in_two_memory_programs`, which warns once per
process when the plugin lacks the kernel) only once every earlier condition holds.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp

from dos_jax.step import paths
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.step.kernel_calls import slot_rows
from dos_jax.kernels import host_adamw
from dos_jax.kernels import host_adamw_rows
from dos_jax.implementation import Program


class Kernel(enum.Enum):
  """The AdamW kernels a step may use (`UpdateImpl.KERNEL` asks for them)."""

  # `kernels.host_adamw_rows`: host rows in one native call, every row of the CPU
  # program, and the two-memory program's host tier inside a host region.
  NATIVE_HOST = 'native_host'
  # `kernels.pallas_adamw`: a streamed or resident block of the two-memory program,
  # on the device.
  PALLAS = 'pallas'


class Capability(NamedTuple):
  """Whether a kernel can run a step, and why not."""

  usable: bool
  reason: str  # the first condition that fails; '' when usable


USABLE = Capability(True, '')


def capability(kernel: Kernel, adamw: AdamWHyperparams | None, step: paths.RowStep,
               program: Program, grad_leaves: Sequence[Any] = ()) -> Capability:
  """Whether `kernel` can update the rows of `step` in `program`.

  Args:
    kernel: which kernel.
    adamw: AdamW's hyperparameters when the transform is `dos_jax.adamw`, else None.
    step: the step's row update (its slots, master, dtypes).
    program: the program the state was built for (`Partition.two_memories`).
    grad_leaves: the step's gradient leaves (read by `Kernel.NATIVE_HOST` only).

  Returns:
    `Capability(True, '')`, or `Capability(False, why)`.
  """
  if adamw is None:
    return Capability(False, 'the transform is not dos_jax.adamw (the kernels compute AdamW '
                      'only)')
  if kernel is Kernel.PALLAS:
    return _pallas(step, program)
  return _native_host(adamw, step, program, grad_leaves)


def _adamw_layout(step: paths.RowStep) -> Capability:
  """AdamW's state as the kernels read it: one float32 group holding (master,) mu, nu."""
  if slot_rows(step.slots, step.has_master) is None:
    return Capability(False, "the state is not AdamW's one float32 group of (master,) mu, nu")
  return USABLE


def _pallas(step: paths.RowStep, program: Program) -> Capability:
  if program is not Program.TWO_MEMORIES:
    return Capability(False, 'the CPU program updates every row with the native host call')
  return _adamw_layout(step)


def _native_host(adamw: AdamWHyperparams, step: paths.RowStep, program: Program,
                 grad_leaves: Sequence[Any]) -> Capability:
  if adamw.nesterov:
    # The kernel rounds Nesterov's sum an ulp apart from XLA's program in a few
    # elements; the native path promises bit-identical results, so XLA keeps it.
    return Capability(False, 'Nesterov momentum (the kernel is not bit-identical to XLA there)')
  if not host_adamw_rows.rows_kernel_available():
    return Capability(False, host_adamw_rows.rows_kernel_unavailable_reason())
  layout = _adamw_layout(step)
  if not layout.usable:
    return layout
  # One gradient dtype: XLA rounds a moment's FMA by whether the gradient arrives as
  # bf16 or f32 (see host_adamw_rows.cc); packed rows of mixed leaves blur that.
  grad_dtypes = {jnp.dtype(g.dtype) for g in grad_leaves}
  if len(grad_dtypes) != 1 or next(iter(grad_dtypes)) not in host_adamw.GRAD_DTYPES:
    names = ', '.join(sorted(d.name for d in grad_dtypes))
    return Capability(False, f'gradients must be all float32 or all bfloat16, got {names}')
  if jnp.dtype(step.out_dtype) not in host_adamw.LOWP_DTYPES:
    return Capability(False, f'parameters of dtype {jnp.dtype(step.out_dtype).name}')
  if program is Program.TWO_MEMORIES:
    # For a GPU the host regions run in the CUDA plugin's own XLA: the kernel must be
    # registered and proven there too, else (one warning) XLA's host loop runs instead.
    # On the CPU backend they run in jaxlib's XLA, which has it.
    return Capability(*host_adamw_rows.host_kernel_in_two_memory_programs())
  return USABLE
