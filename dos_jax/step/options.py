"""`StepOptions`: what one step needs of the user's `Offload`, taken once by `update`."""

from __future__ import annotations

import dataclasses

from dos_jax import compiler_options
from dos_jax.offload import Offload
from dos_jax.offload import UpdateImpl


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The implementations, the state's mesh axis and the host threads of one step.

  Attributes:
    host_impl: the host path's implementation (the native kernel, or XLA's ops).
    device_impl: the device path's (the Pallas kernel, or XLA's ops).
    data_axis: the mesh axis the state is split over.
    host_threads: threads of the native host kernel (None: the cores available).
    async_compute_limit: `Offload.async_compute_limit` (None: resolved while the
      step is traced, `grouped_lanes`).

  >>> import dos_jax
  >>> StepOptions.of(dos_jax.Offload(host_threads=2)).host_threads
  2
  """

  host_impl: UpdateImpl = UpdateImpl.KERNEL
  device_impl: UpdateImpl = UpdateImpl.KERNEL
  data_axis: str = 'data'
  host_threads: int | None = None
  async_compute_limit: int | None = None

  @classmethod
  def of(cls, offload: Offload) -> 'StepOptions':
    return cls(host_impl=offload.host_impl, device_impl=offload.device_impl,
               data_axis=offload.data_axis, host_threads=offload.host_threads,
               async_compute_limit=offload.async_compute_limit)

  def grouped_lanes(self) -> int:
    """The stream lanes the host call's scheduling group may hold: one less than the
    limit on asynchronous calls in flight of the program being traced (the group's
    host call is one of them; `compiler_options.async_compute_limit`)."""
    return max(0, compiler_options.async_compute_limit(self.async_compute_limit) - 1)
