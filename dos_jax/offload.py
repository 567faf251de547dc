"""`Offload`: how the optimizer state is split, placed and updated."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from dos_jax.policies import Policy
from dos_jax.policies import Stride


class UpdateImpl(enum.Enum):
  """Which implementation runs the AdamW update on one path.

  KERNEL: the fused kernel (Pallas on GPU for the device path, the native host AdamW for
    the host path) where it is available, else XLA.
  XLA: optax's own element-wise ops, fused by XLA. The reference and the fallback.
  """

  KERNEL = 'kernel'
  XLA = 'xla'


@dataclasses.dataclass(frozen=True)
class Offload:
  """Configuration of the offloaded optimizer state.

  Attributes:
    subgroup_size: elements per subgroup, the unit of placement (the paper used 1e8 on
      7B-20B models). Smaller models get one subgroup sized to fit.
    policy: where each subgroup is updated: `AllHost()`, `AllDevice()`, `Stride(k)`,
      `DeviceFraction(f)` or `Auto()`.
    mesh: the device mesh whose `data_axis` shards the host state (ZeRO-1 style). When
      None it is taken from the params' `NamedSharding` at `init`, if they have one.
    data_axis: name of the mesh axis the state is sharded over.
    device_impl: implementation of the device-path update.
    host_impl: implementation of the host-path update.
    host_threads: threads for the native host update (None: the cores available).
  """

  subgroup_size: int = 100_000_000
  policy: Policy = Stride(2)
  mesh: Any = None
  data_axis: str = 'data'
  device_impl: UpdateImpl = UpdateImpl.KERNEL
  host_impl: UpdateImpl = UpdateImpl.KERNEL
  host_threads: int | None = None

  def __post_init__(self):
    size = self.subgroup_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
      raise ValueError(f'Offload.subgroup_size must be a positive integer, got {size!r}')
    if not isinstance(self.policy, Policy):
      raise TypeError(
          f'Offload.policy must be a placement policy such as dos_jax.AllHost(),'
          f' dos_jax.Stride(2) or dos_jax.Auto(); got {self.policy!r}'
      )
    for name in ('device_impl', 'host_impl'):
      if not isinstance(getattr(self, name), UpdateImpl):
        raise TypeError(
            f'Offload.{name} must be a dos_jax.UpdateImpl, got {getattr(self, name)!r}'
        )
    if self.host_threads is not None and (
        not isinstance(self.host_threads, int) or self.host_threads < 1
    ):
      raise ValueError(f'Offload.host_threads must be >= 1, got {self.host_threads!r}')
