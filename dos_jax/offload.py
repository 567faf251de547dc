"""`Offload`: how the optimizer state is split, placed and updated."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax

from dos_jax import compiler_options
from dos_jax.policies import Policy
from dos_jax.policies import Stride


class Program(enum.Enum):
  """Which program the update builds, whatever backend it is traced on.

  ONE_MEMORY: host and device memory are one. Every subgroup, whatever the plan says,
    takes the same host update in one call (a loop that copies a row to where it
    already is would only cost time), and the state is one array per dtype.
  TWO_MEMORIES: the accelerator program, host and device memory apart. The state is
    split by the plan into separately stored tiers; streamed subgroups go host ->
    device -> host through the Pallas AdamW, host subgroups are updated in a
    `compute_on('device_host')` region, and the two have no data dependency, so XLA can
    run them at the same time. It can be lowered for 'cuda' on a machine without a GPU,
    and it also runs on the CPU backend (Pallas in interpret mode there), which is how
    CI checks its numbers.

  The values are the strings `Offload(platform=...)` and run configs take: 'cpu' and
  'gpu'.
  """

  ONE_MEMORY = 'cpu'
  TWO_MEMORIES = 'gpu'

  @classmethod
  def of_backend(cls, backend: str) -> Program:
    """The program for a JAX backend name: ONE_MEMORY for 'cpu', TWO_MEMORIES for every
    accelerator."""
    return cls.ONE_MEMORY if backend == 'cpu' else cls.TWO_MEMORIES


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


class UpdateImpl(enum.Enum):
  """Which implementation runs the AdamW update on one path.

  KERNEL: a kernel (the Pallas AdamW for the device path, the native host AdamW for the
    host path) where it is available, else XLA.
  XLA: optax's own element-wise ops, fused by XLA. The reference and the fallback.
  """

  KERNEL = 'kernel'
  XLA = 'xla'


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
    device_impl: implementation of the device-path update (`UpdateImpl.XLA`: optax's
      own ops, the reference).
    host_impl: implementation of the host-path update (`UpdateImpl.XLA`: optax's own
      ops in one host region, the reference).
    host_threads: threads for the native host update (None: the cores available).
    async_compute_limit: the asynchronous calls XLA may keep in flight in the program
      this step is compiled into (`xla_gpu_experimental_parallel_async_compute_limit`,
      2 unless set; `GPU_COMPILER_OPTIONS` sets 3). None: known where dos_jax jits the
      step (`dos_jax.jit`, the runner), else `XLA_FLAGS`'s, else 2
      (`compiler_options.async_compute_limit`). The host call's scheduling group holds
      `limit - 1` stream lanes: with 3, both lanes run beside the host call in every
      schedule; a group over the limit stops the latency-hiding scheduler (RET_CHECK
      latency_hiding_scheduler.cc:2567, 8x1024 Stride(2) and 10x768
      DeviceFraction(0.5), tests/test_compiled_options.py).
    disk: the disk tier (`Disk`): host subgroups beyond a host-memory budget keep
      their state in files. None: none.
    platform: which program to build (`Program`, or its value 'cpu' / 'gpu'); None
      follows the backend `init` runs on (`jax.default_backend()`). The state keeps
      the choice: every step of it builds that program. 'gpu' on the CPU backend runs
      the accelerator program there (Pallas interpreted): how CI tests its numbers.

  What the library decides, not the user: on the accelerator program the state is
  stored per subgroup, the device tiers run on stream lanes (`Plan.buffers` of them)
  grouped with the last host call, and the host tier runs in host calls in backward
  order that start as soon as their gradients reach host memory (`dos_jax.Schedule`,
  chosen at `init` by the policy's cost model or a fixed rule, and carried in the
  state). docs/design.md describes that one construction.

  Example:
    >>> import dos_jax
    >>> dos_jax.Offload(subgroup_size=10**8, policy=dos_jax.Stride(2)).policy
    Stride(k=2, buffers=2)
  """

  subgroup_size: int = 100_000_000
  policy: Policy = Stride(2)
  mesh: Any = None
  data_axis: str = 'data'
  device_impl: UpdateImpl = UpdateImpl.KERNEL
  host_impl: UpdateImpl = UpdateImpl.KERNEL
  host_threads: int | None = None
  async_compute_limit: int | None = None
  disk: Disk | None = None
  platform: Program | None = None

  def __post_init__(self):
    if self.platform is not None and not isinstance(self.platform, Program):
      try:
        object.__setattr__(self, 'platform', Program(self.platform))
      except ValueError:
        raise ValueError(
            "Offload.platform must be None, a dos_jax.Program, 'cpu' or 'gpu',"
            f' got {self.platform!r}'
        ) from None
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
    for name in ('device_impl', 'host_impl'):
      if not isinstance(getattr(self, name), UpdateImpl):
        raise TypeError(
            f'Offload.{name} must be a dos_jax.UpdateImpl, got {getattr(self, name)!r}'
        )
    if self.host_threads is not None and (
        not isinstance(self.host_threads, int) or isinstance(self.host_threads, bool)
        or self.host_threads < 1
    ):
      raise ValueError(f'Offload.host_threads must be >= 1, got {self.host_threads!r}')

    limit = self.async_compute_limit
    if limit is None:
      compiler_options.xla_flags_async_compute_limit()  # a bad value named now, not in a trace
    elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
      raise ValueError(f'Offload.async_compute_limit must be an integer >= 1 (XLA\'s '
                       f'xla_gpu_experimental_parallel_async_compute_limit), got {limit!r}')
    if self.disk is not None and not isinstance(self.disk, Disk):
      raise TypeError(f'Offload.disk must be None or a dos_jax.Disk, got {self.disk!r}')

  def target(self) -> Program:
    """The program a state built now is for: `platform`, or the default backend's."""
    if self.platform is not None:
      return self.platform
    return Program.of_backend(jax.default_backend())
