"""Placement policies: which optimizer-state subgroups are updated where.

A *policy* is a small immutable value chosen by the user (`AllHost()`, `Stride(2)`,
`ResidentFraction(0.3, then=Stride(2))`, ...). Given the shape of the packed state (a
`SubgroupSpec`) it produces a `Plan` with one of three placements per subgroup:
resident in device memory, streamed through the device (in the order they are
streamed), or updated on the host. Plans are hashable so that a jitted step can take one as a static
argument and compile each distinct plan exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable



@dataclasses.dataclass(frozen=True)
class SubgroupSpec:
  """What a policy needs to know about the packed optimizer state.

  Attributes:
    num_subgroups: number of rows of the packed state (the last may be padded).
    subgroup_size: elements per subgroup row.
    num_elements: real (unpadded) parameter elements across all subgroups.
    state_bytes_per_element: bytes of host-resident state per element (fp32 master
      if kept, m in `mu_dtype`, v in fp32): 8 to 12.
    param_bytes_per_element: bytes of the low-precision parameter copy (2 or 4).
    grad_bytes_per_element: bytes of one gradient element as packed (2 or 4).
    decayed_rows: rows `[0, decayed_rows)` hold the weight-decayed leaves; the rows
      past them hold the others (the norm scales of every layer), whose gradients are
      complete only at the end of the backward pass (`planner.timeline`). None: not
      known, every row's gradients made in backward order.
  """

  num_subgroups: int
  subgroup_size: int
  num_elements: int
  state_bytes_per_element: int = 12
  param_bytes_per_element: int = 4
  grad_bytes_per_element: int = 4
  decayed_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each subgroup's state lives and is updated in one step: three placements.

  Attributes:
    streamed: subgroup indices of the streamed tier: state in pinned host memory,
      copied host -> device, updated there and copied back, in this order.
    host: subgroup indices updated in host memory by the host path, in this order.
    resident: subgroup indices whose state stays in device memory and is updated
      there, with no copies at all (every subgroup: the `AllDevice` baseline).
    buffers: streamed subgroups in flight at once (double buffering = 2): the
      two-memory program's stream lanes, each on a GPU stream of its own, that the
      streamed rows go round-robin over (`dos_jax.step.lanes`). Every streamed row is
      held in device memory until the lanes are done
      (`planner.costmodel.streamed_elements_held`).
  """

  streamed: tuple[int, ...]
  host: tuple[int, ...]
  resident: tuple[int, ...] = ()
  buffers: int = 2

  def __post_init__(self):
    self._check()

  def _check(self):
    for name in ('streamed', 'host', 'resident'):
      value = getattr(self, name)
      if not isinstance(value, tuple) or not all(
          isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise TypeError(f'Plan.{name} must be a tuple of subgroup indices, got {value!r}')
    everything = sorted(self.streamed + self.host + self.resident)
    if everything != list(range(len(everything))):
      raise ValueError(
          f'Plan must name every subgroup exactly once; got resident={self.resident},'
          f' streamed={self.streamed}, host={self.host}'
      )
    if self.buffers < 1:
      raise ValueError(f'Plan.buffers must be >= 1, got {self.buffers}')

  @property
  def num_subgroups(self) -> int:
    return len(self.streamed) + len(self.host) + len(self.resident)

  @property
  def all_resident(self) -> bool:
    """Whether every subgroup stays in device memory (the no-offload baseline)."""
    return len(self.resident) == self.num_subgroups

  def describe(self) -> str:
    """One line: how many subgroups go where."""
    n = self.num_subgroups
    if self.all_resident:
      return f'{n} subgroups resident on device'
    streamed = (f'{len(self.streamed)}/{n} subgroups streamed to device'
                f' ({self.buffers} in flight), {len(self.host)} updated on host')
    if not self.resident:
      return streamed
    return f'{len(self.resident)}/{n} subgroups resident on device, ' + streamed.replace(f'/{n}', '', 1)


@runtime_checkable
class Policy(Protocol):
  """Anything that turns a `SubgroupSpec` into a `Plan`."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    ...


@runtime_checkable
class AdaptivePolicy(Protocol):
  """A policy that re-plans as it runs, from measured update times (`dos_jax.Auto`).

  A runner passes each step's plan to the step as a static argument and reports the
  measured update time to `observe`, which returns the plan for the next step. The
  state is stored per subgroup, so a change of plan moves only the rows that change
  tier.
  """

  def plan(self, spec: SubgroupSpec) -> Plan:
    ...

  def observe(self, plan: Plan, measured_update_seconds: float) -> Plan:
    ...


def _checked_count(spec: SubgroupSpec) -> int:
  if spec.num_subgroups < 1:
    raise ValueError(f'num_subgroups must be >= 1, got {spec.num_subgroups}')
  return spec.num_subgroups


@dataclasses.dataclass(frozen=True)
class AllHost:
  """Every subgroup updated on the host: the ZeRO-Offload baseline."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    return Plan(streamed=(), host=tuple(range(_checked_count(spec))))


@dataclasses.dataclass(frozen=True)
class AllDevice:
  """State kept in device memory and updated there: the no-offload baseline."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    return Plan(streamed=(), host=(), resident=tuple(range(_checked_count(spec))))


@dataclasses.dataclass(frozen=True)
class Stride:
  """Every k-th subgroup (0, k, 2k, ...) streamed to the device: the paper's method.

  `Stride(1)` streams every subgroup; `Stride(2)` half of them.
  """

  k: int
  buffers: int = 2

  def __post_init__(self):
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
      raise ValueError(f'Stride.k must be an integer >= 1, got {self.k!r}')

  def plan(self, spec: SubgroupSpec) -> Plan:
    n = _checked_count(spec)
    streamed = tuple(i for i in range(n) if i % self.k == 0)
    host = tuple(i for i in range(n) if i % self.k != 0)
    return Plan(streamed=streamed, host=host, buffers=self.buffers)


@dataclasses.dataclass(frozen=True)
class DeviceFraction:
  """A fraction `f` of the subgroups streamed to the device, spread evenly."""

  f: float
  buffers: int = 2

  def __post_init__(self):
    if not (isinstance(self.f, (int, float)) and 0.0 <= self.f <= 1.0):
      raise ValueError(f'DeviceFraction.f must be in [0, 1], got {self.f!r}')

  def plan(self, spec: SubgroupSpec) -> Plan:
    n = _checked_count(spec)
    count = int(round(self.f * n))
    # Spread the streamed subgroups evenly: subgroup i is streamed when the
    # running share floor((i+1)*count/n) steps up.
    streamed = tuple(
        i for i in range(n) if math.floor((i + 1) * count / n) > math.floor(i * count / n)
    )
    host = tuple(i for i in range(n) if i not in set(streamed))
    return Plan(streamed=streamed, host=host, buffers=self.buffers)


def _then_plan(then: 'Policy', spec: SubgroupSpec, resident: int) -> Plan:
  """`then`'s plan over the subgroups after the first `resident`, which stay resident."""
  n = _checked_count(spec)
  head = tuple(range(resident))
  if resident == n:
    return Plan(streamed=(), host=(), resident=head)
  rest = dataclasses.replace(
      spec, num_subgroups=n - resident,
      num_elements=min(spec.num_elements, (n - resident) * spec.subgroup_size))
  sub = then.plan(rest)
  if sub.resident:
    raise ValueError(f'{then!r} keeps subgroups resident: combine resident counts in one policy')
  shift = lambda ids: tuple(resident + i for i in ids)
  return Plan(streamed=shift(sub.streamed), host=shift(sub.host), resident=head,
              buffers=sub.buffers)


@dataclasses.dataclass(frozen=True)
class Resident:
  """The first `n` subgroups resident in device memory; `then` places the rest.

  `Resident(4, then=Stride(2))` keeps subgroups 0-3 on the device and streams every
  second one of the others. With `then=AllHost()` (the default) this is a fixed
  device-resident share, as DeepSpeed's Twin-Flow keeps. An `n` above the subgroup
  count is an error, not a silent clip.
  """

  n: int
  then: 'Policy' = dataclasses.field(default_factory=AllHost)

  def __post_init__(self):
    if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 0:
      raise ValueError(f'Resident.n must be an integer >= 0, got {self.n!r}')
    _check_then(self.then, 'Resident')

  def plan(self, spec: SubgroupSpec) -> Plan:
    n = _checked_count(spec)
    if self.n > n:
      raise ValueError(f'Resident({self.n}): the state has only {n} subgroups')
    return _then_plan(self.then, spec, self.n)


@dataclasses.dataclass(frozen=True)
class ResidentFraction:
  """A fraction `f` of the subgroups (rounded, the first ones) resident in device
  memory; `then` places the rest, e.g. `ResidentFraction(0.3, then=Stride(2))`."""

  f: float
  then: 'Policy' = dataclasses.field(default_factory=AllHost)

  def __post_init__(self):
    if not (isinstance(self.f, (int, float)) and not isinstance(self.f, bool)
            and 0.0 <= self.f <= 1.0):
      raise ValueError(f'ResidentFraction.f must be in [0, 1], got {self.f!r}')
    _check_then(self.then, 'ResidentFraction')

  def plan(self, spec: SubgroupSpec) -> Plan:
    n = _checked_count(spec)
    return _then_plan(self.then, spec, int(round(self.f * n)))


def _check_then(then, owner: str) -> None:
  if not isinstance(then, Policy) or isinstance(then, type):
    raise TypeError(f'{owner}.then must be a placement policy such as Stride(2), got {then!r}')
