"""`Offload`: how the optimizer state is split, placed and updated."""

from __future__ import annotations

import dataclasses
from typing import Any

from dos_jax.policies import Policy
from dos_jax.policies import Stride


@dataclasses.dataclass(frozen=True)
class Disk:
  """The disk tier: host-updated subgroups whose state lives in files, not in memory.

  Attributes:
    directory: where the state files go (local NVMe for speed); made if missing. Each
      disk subgroup has two files, the current step's and the next one's
      (`dos_jax.kernels.host_adamw_disk`), so a step that fails midway leaves the
      state at the step before.
    host_state_bytes: host memory the host tier's state may take; the host subgroups
      beyond it go to disk (the first layers' first: their gradients come last, so the
      early host calls keep theirs in memory). None: every host subgroup on disk.
    direct_io: open the files with O_DIRECT where the filesystem takes it (no page
      cache: the state passes through memory once per step).

  Example:
    >>> import dos_jax
    >>> dos_jax.Offload(disk=dos_jax.Disk('/tmp/state', host_state_bytes=2**30)).disk.directory
    '/tmp/state'
  """

  directory: str
  host_state_bytes: int | None = None
  direct_io: bool = True

  def __post_init__(self):
    if not isinstance(self.directory, str) or not self.directory:
      raise ValueError(f'Disk.directory must be a non-empty path, got {self.directory!r}')
    cap = self.host_state_bytes
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
      raise ValueError(f'Disk.host_state_bytes must be None or bytes >= 0, got {cap!r}')


@dataclasses.dataclass(frozen=True)
class Offload:
  """What a user decides about the offloaded optimizer state.

  Attributes:
    subgroup_size: elements per subgroup, the unit of placement (the paper used 1e8 on
      7B-20B models). Smaller models get one subgroup sized to fit.
    policy: where each subgroup is updated: `AllHost()`, `AllDevice()`, `Stride(k)`,
      `DeviceFraction(f)` or `Auto()`.
    mesh: the device mesh whose `data_axis` shards the host state (ZeRO-1 style). When
      None it is taken from the params' `NamedSharding` at `init`, if they have one.
    data_axis: name of the mesh axis the state is sharded over.
    host_threads: threads for the native host update (None: the cores available).
    disk: the disk tier (`Disk`): host subgroups beyond a host-memory budget keep
      their state in files. None: none.

  What the library decides, not the user: on the two-memory program the state is
  stored per subgroup, the device tiers run on stream lanes (`Plan.buffers` of them)
  grouped with the last host call, and the host tier runs in host calls in backward
  order that start as soon as their gradients reach host memory (the early host calls,
  `Partition.early`, chosen at `init` by the policy's cost model or a fixed rule, and
  carried in the state). docs/design.md describes that one construction. The program follows the
  backend `init` runs on and the updates take the kernels where they are available
  (`dos_jax.Implementation` says otherwise, for tests and benchmarks); the limit on
  asynchronous calls in flight that groups the stream lanes is that of the options
  the step is compiled with (`dos_jax.jit`, else `XLA_FLAGS`, else XLA's 2).

  Example:
    >>> import dos_jax
    >>> dos_jax.Offload(subgroup_size=10**8, policy=dos_jax.Stride(2)).policy
    Stride(k=2, buffers=2)
  """

  subgroup_size: int = 100_000_000
  policy: Policy = Stride(2)
  mesh: Any = None
  data_axis: str = 'data'
  host_threads: int | None = None
  disk: Disk | None = None

  def __post_init__(self):
    size = self.subgroup_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
      raise ValueError(f'Offload.subgroup_size must be a positive integer, got {size!r}')
    if isinstance(self.policy, type):
      raise TypeError(
          f'Offload.policy must be a policy instance, e.g. dos_jax.{self.policy.__name__}(...),'
          f' not the class {self.policy.__name__}')
    if not isinstance(self.policy, Policy):
      raise TypeError(
          f'Offload.policy must be a placement policy such as dos_jax.AllHost(),'
          f' dos_jax.Stride(2) or dos_jax.Auto(); got {self.policy!r}'
      )
    if self.host_threads is not None and (
        not isinstance(self.host_threads, int) or isinstance(self.host_threads, bool)
        or self.host_threads < 1
    ):
      raise ValueError(f'Offload.host_threads must be >= 1, got {self.host_threads!r}')
    if self.disk is not None and not isinstance(self.disk, Disk):
      raise TypeError(f'Offload.disk must be None or a dos_jax.Disk, got {self.disk!r}')
