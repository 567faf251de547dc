"""`Offload`: how the optimizer state is split, placed and updated."""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Any

import jax

from dos_jax.policies import AdaptivePolicy
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
  'gpu'. `CPU` and `GPU` are the deprecated names of the members (of the deprecated
  `Platform`), kept for one release.
  """

  ONE_MEMORY = 'cpu'
  TWO_MEMORIES = 'gpu'
  CPU = 'cpu'  # Deprecated alias of ONE_MEMORY.
  GPU = 'gpu'  # Deprecated alias of TWO_MEMORIES.

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


class Storage(enum.Enum):
  """How each tier of the accelerator program's state is stored.

  STACKED: one `(R, K, S)` array per dtype per tier. The row loop is one `fori_loop`
    (compile time independent of the number of subgroups) and its `buffers` bound the
    streamed rows in flight. A plan change copies every tier whose subgroups change.
  PER_SUBGROUP: one `(1, K, S)` array per dtype per subgroup. A plan change moves only
    the rows that change tier (a row that changes only its path, host or streamed,
    moves not at all), and every other row keeps its buffer under donation: no tier is
    ever held twice. The program has one update per subgroup, and the streamed rows are
    chained so that at most `buffers` are in flight.
  """

  STACKED = 'stacked'
  PER_SUBGROUP = 'per_subgroup'


class EarlyChunks(enum.Enum):
  """`Offload.early_chunks` left to the placement policy."""

  # The policy's `early_chunks(spec, plan)` (`dos_jax.Auto` weighs the backward pass
  # against the host work and the clip rate); none for a policy without one.
  AUTO = 'auto'


def _chooses(early: Any) -> bool:
  """Whether an `Offload.early_chunks` value is a chooser: an object whose
  `early_chunks(spec, plan)` gives the early call sizes (`planner.timeline.EarlyChooser`)."""
  return callable(getattr(early, 'early_chunks', None))


def early_calls(early: Any) -> int:
  """How many host calls an `Offload.early_chunks` value asks for at most (1: one call;
  2 for `EarlyChunks.AUTO` or a chooser, which may ask for several)."""
  if isinstance(early, EarlyChunks) or _chooses(early):
    return 2
  return len(early) + 1 if isinstance(early, tuple) else max(1, early)


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
    platform: which program to build (`Program`, or its value 'cpu' / 'gpu'); None
      follows the backend `init` runs on (`jax.default_backend()`). The state keeps
      the choice (`Partition.split`): every step of it builds that program.
    storage: how the accelerator program stores each tier (`Storage`); None:
      per subgroup when the policy re-plans as it runs (an `AdaptivePolicy`, such as
      `Auto`), so that its plan changes move only the rows that change tier, or when
      `early_chunks` asks for early host calls, else stacked. The one-memory program
      keeps one stacked array.
    chunks: the accelerator program's host tier updated in this many host calls, each
      linked through the device to a part of the streamed tier (`dos_jax.step.chunked`):
      host and device work then interleave chunk by chunk, and each host call can
      start as soon as its own gradients are on the host. 0: one host call. Needs
      per-subgroup storage (stacked rows would chain every chunk's stream through one
      tier array); applies with the native host kernel, an unsharded state, and both
      host and streamed subgroups (experiments/RESULTS.md).
    early_chunks: the accelerator program's host tier in several host calls, the last
      subgroups first, each starting as soon as its gradients are in host memory:
      all but the last during the backward pass (`dos_jax.step.early_chunks`). An int K: K
      calls of near-equal size; a tuple of sizes (subgroups per early call, what
      `dos_jax.planner.timeline.choose_early_chunks` gives): those, and a last call
      with the rest. `EarlyChunks.AUTO`: what the policy chooses for the plan
      (`dos_jax.Auto.early_chunks`), none for a policy that does not choose. A chooser
      (`dos_jax.planner.timeline.EarlyChooser`): what it chooses for the plan. Under
      `dos_jax.clip_by_global_norm` those speculate on a clip factor of 1 and are redone
      after the backward pass when the factor is not 1, exactly. 0 or 1: one host call
      after the backward pass. Needs per-subgroup storage; applies with the native host
      kernel and an unsharded state; not with `chunks`.
    device_stream: the accelerator program's device tiers updated in stream regions
      on GPU streams of their own, in one scheduling group with the host call, so that
      the two run concurrently in every schedule (`dos_jax.step.device_stream`; with
      `chunks`, each chunk's device part with its host call). Applies to per-subgroup
      storage with an unsharded state; compile with `GPU_COMPILER_OPTIONS`. False: the
      device update is left to XLA's scheduler.
    stream_lanes: with `device_stream`, the stream regions (lanes) the streamed rows go
      round-robin over, each on a CUDA stream of its own: XLA runs a region's copies
      one after another, so consecutive rows in different lanes are what lets a
      write-back and the next fetch share the link (docs/design.md, rule 3). 0: the
      plan's `buffers` (the default); 1: one region, every transfer in turn.
  """

  subgroup_size: int = 100_000_000
  policy: Policy = Stride(2)
  mesh: Any = None
  data_axis: str = 'data'
  device_impl: UpdateImpl = UpdateImpl.KERNEL
  host_impl: UpdateImpl = UpdateImpl.KERNEL
  host_threads: int | None = None
  platform: Program | None = None
  storage: Storage | None = None
  chunks: int = 0
  device_stream: bool = True
  early_chunks: Any = 0  # int, tuple of ints, EarlyChunks or a chooser
  stream_lanes: int = 0

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
    if self.storage is not None and not isinstance(self.storage, Storage):
      raise TypeError(f'Offload.storage must be None or a dos_jax.Storage, got {self.storage!r}')
    if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 0:
      raise ValueError(f'Offload.chunks must be an integer >= 0, got {self.chunks!r}')
    if self.chunks and not self.per_subgroup():
      raise ValueError(
          f'Offload.chunks={self.chunks} needs per-subgroup storage: pass'
          ' storage=dos_jax.Storage.PER_SUBGROUP (an Auto policy uses it by default)')
    early = self.early_chunks
    if isinstance(early, list):
      object.__setattr__(self, 'early_chunks', early := tuple(early))
    if isinstance(early, EarlyChunks) or _chooses(early):
      pass
    elif isinstance(early, tuple):
      if not early or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0
                              for k in early):
        raise ValueError('Offload.early_chunks as a tuple must hold subgroup counts > 0,'
                         f' got {early!r}')
    elif isinstance(early, bool) or not isinstance(early, int) or early < 0:
      raise ValueError('Offload.early_chunks must be an integer >= 0 or a tuple of'
                       f' subgroup counts, got {early!r}')
    if self.early_calls() > 1 and self.chunks:
      raise ValueError(f'Offload.early_chunks={early} and Offload.chunks={self.chunks} do not'
                       ' combine: pass one of them')
    if (self.early_calls() > 1 and not self.per_subgroup()
        and not isinstance(early, EarlyChunks)):
      raise ValueError(
          f'Offload.early_chunks={early} needs per-subgroup storage: leave Offload.storage'
          f' unset (it then defaults to per subgroup) or pass'
          f' storage=dos_jax.Storage.PER_SUBGROUP, not {self.storage}')
    if not isinstance(self.device_stream, bool):
      raise TypeError(f'Offload.device_stream must be True or False, got {self.device_stream!r}')
    lanes = self.stream_lanes
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 0:
      raise ValueError(f'Offload.stream_lanes must be an integer >= 0 (0: the plan\'s'
                       f' buffers), got {lanes!r}')
    if self.host_threads is not None and (
        not isinstance(self.host_threads, int) or self.host_threads < 1
    ):
      raise ValueError(f'Offload.host_threads must be >= 1, got {self.host_threads!r}')

  def early_calls(self) -> int:
    """How many host calls `early_chunks` asks for at most (`early_calls`)."""
    return early_calls(self.early_chunks)

  def early_for(self, spec, plan) -> int | tuple[int, ...]:
    """`early_chunks` for a state of `spec` placed by `plan`: the policy's choice for
    `EarlyChunks.AUTO` (0 where it offers none)."""
    if _chooses(self.early_chunks):
      return self.early_chunks.early_chunks(spec, plan)
    if not isinstance(self.early_chunks, EarlyChunks):
      return self.early_chunks
    choose = getattr(self.policy, 'early_chunks', None)
    return 0 if choose is None else choose(spec, plan)

  def per_subgroup(self) -> bool:
    """Whether tiers are stored per subgroup (see `storage`)."""
    if self.storage is not None:
      return self.storage is Storage.PER_SUBGROUP
    asks_early = (not isinstance(self.early_chunks, EarlyChunks)
                  and early_calls(self.early_chunks) > 1)  # a chooser asks too
    return asks_early or isinstance(self.policy, AdaptivePolicy)

  def target(self) -> Program:
    """The program a state built now is for: `platform`, or the default backend's."""
    if self.platform is not None:
      return self.platform
    return Program.of_backend(jax.default_backend())


PLATFORM_RENAMED = ('dos_jax.Platform is deprecated: use dos_jax.Program'
                    ' (Platform.GPU is Program.TWO_MEMORIES, Platform.CPU is Program.ONE_MEMORY)')


def __getattr__(name: str) -> Any:
  """`Platform`, the deprecated name of `Program`, for one release."""
  if name == 'Platform':
    warnings.warn(PLATFORM_RENAMED, DeprecationWarning, stacklevel=2)
    return Program
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
