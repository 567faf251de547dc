"""`Implementation`: which program a state is built for and which code updates it.

For tests, benchmarks and experts; users leave it out (every entry that takes one
defaults to `Implementation()`: the program of the backend `init` runs on, the kernels
where they are available).
"""

from __future__ import annotations

import dataclasses
import enum

import jax


class Program(enum.Enum):
  """Which program the update builds, whatever backend it is traced on.

  ONE_MEMORY: host and device memory are one. Every subgroup, whatever the plan says,
    takes the same host update in one call (a loop that copies a row to where it
    already is would only cost time), and the state is one array per dtype.
  TWO_MEMORIES: the two-memory program, host and device memory apart. The state is
    split by the plan into separately stored tiers; streamed subgroups go host ->
    device -> host through the Pallas AdamW, host subgroups are updated in a
    `compute_on('device_host')` region, and the two have no data dependency, so XLA can
    run them at the same time. It can be lowered for 'cuda' on a machine without a GPU,
    and it also runs on the CPU backend (Pallas in interpret mode there), which is how
    CI checks its numbers.

  The values are the strings `Implementation(program=...)` and run configs
  (`offload.platform`) take: 'cpu' and 'gpu'.
  """

  ONE_MEMORY = 'cpu'
  TWO_MEMORIES = 'gpu'

  @classmethod
  def of_backend(cls, backend: str) -> Program:
    """The program for a JAX backend name: ONE_MEMORY for 'cpu', TWO_MEMORIES for every
    accelerator."""
    return cls.ONE_MEMORY if backend == 'cpu' else cls.TWO_MEMORIES


class UpdateImpl(enum.Enum):
  """Which implementation runs the AdamW update on one path.

  KERNEL: a kernel (the Pallas AdamW for the device path, the native host AdamW for the
    host path) where it is available, else XLA.
  XLA: optax's own element-wise ops, fused by XLA. The reference and the fallback.
  """

  KERNEL = 'kernel'
  XLA = 'xla'


@dataclasses.dataclass(frozen=True)
class Implementation:
  """Which program a state is built for and which code runs its updates: for tests,
  benchmarks and experts; users leave it out.

  Attributes:
    program: which program to build (`Program`, or its value 'cpu' / 'gpu'); None
      follows the backend `init` runs on (`jax.default_backend()`). The state keeps
      the choice: every step of it builds that program. 'gpu' on the CPU backend runs
      the two-memory program there (Pallas interpreted): how CI tests its numbers.
    device: implementation of the device-path update (`UpdateImpl.XLA`: optax's own
      ops, the reference).
    host: implementation of the host-path update (`UpdateImpl.XLA`: optax's own ops in
      one host region, the reference).
    two_streams: the two-memory program's host and device tiers concurrent by
      construction (`dos_jax.step.lanes`: stream regions beside the host calls); False:
      the tiers' updates one after the other in one program, left to XLA's scheduler
      (the reference the construction is compared with, bit for bit).

  Example:
    The two-memory program on any backend, with XLA's ops on the device path:

    >>> import dos_jax
    >>> impl = dos_jax.Implementation(program='gpu', device=dos_jax.UpdateImpl.XLA)
    >>> impl.target(), impl.host
    (<Program.TWO_MEMORIES: 'gpu'>, <UpdateImpl.KERNEL: 'kernel'>)
  """

  program: Program | None = None
  device: UpdateImpl = UpdateImpl.KERNEL
  host: UpdateImpl = UpdateImpl.KERNEL
  two_streams: bool = True

  def __post_init__(self):
    if self.program is not None and not isinstance(self.program, Program):
      try:
        object.__setattr__(self, 'program', Program(self.program))
      except (ValueError, TypeError):
        raise ValueError(
            "Implementation.program must be None, a dos_jax.Program, 'cpu' or 'gpu',"
            f' got {self.program!r}') from None
    for name in ('device', 'host'):
      if not isinstance(getattr(self, name), UpdateImpl):
        raise TypeError(f'Implementation.{name} must be a dos_jax.UpdateImpl, got '
                        f'{getattr(self, name)!r}')
    if not isinstance(self.two_streams, bool):
      raise TypeError(f'Implementation.two_streams must be a bool, got {self.two_streams!r}')

  def target(self) -> Program:
    """The program a state built now is for: `program`, or the default backend's.

    >>> import dos_jax
    >>> dos_jax.Implementation(program='cpu').target()
    <Program.ONE_MEMORY: 'cpu'>
    """
    if self.program is not None:
      return self.program
    return Program.of_backend(jax.default_backend())
