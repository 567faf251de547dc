"""`StepOptions`: what one step needs of the user's `Offload` and the `Implementation`,
taken once by `update`."""

from __future__ import annotations

import dataclasses

from dos_jax import compiler_options
from dos_jax.implementation import Implementation
from dos_jax.implementation import UpdateImpl
from dos_jax.offload import Offload


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The implementations, the state's mesh axis and the host threads of one step.

  Attributes:
    host: the host path's implementation (the native kernel, or XLA's ops).
    device: the device path's (the Pallas kernel, or XLA's ops).
    data_axis: the mesh axis the state is split over.
    host_threads: threads of the native host kernel (None: the cores available).

  >>> import dos_jax
  >>> options = StepOptions.of(dos_jax.Offload(host_threads=2),
  ...                          dos_jax.Implementation(host=dos_jax.UpdateImpl.XLA))
  >>> options.host_threads, options.host
  (2, <UpdateImpl.XLA: 'xla'>)
  """

  host: UpdateImpl = UpdateImpl.KERNEL
  device: UpdateImpl = UpdateImpl.KERNEL
  two_streams: bool = True
  data_axis: str = 'data'
  host_threads: int | None = None

  @classmethod
  def of(cls, offload: Offload, implementation: Implementation | None = None
         ) -> 'StepOptions':
    """The options of `offload`'s steps, updated as `implementation` says (None:
    `Implementation()`)."""
    implementation = Implementation() if implementation is None else implementation
    return cls(host=implementation.host, device=implementation.device,
               two_streams=implementation.two_streams, data_axis=offload.data_axis,
               host_threads=offload.host_threads)

  @staticmethod
  def grouped_lanes() -> int:
    """The stream lanes the host call's scheduling group may hold: one less than the
    limit on asynchronous calls in flight of the program being traced (the group's
    host call is one of them; `compiler_options.async_compute_limit`)."""
    return max(0, compiler_options.async_compute_limit() - 1)
