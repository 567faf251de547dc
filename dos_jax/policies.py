"""Placement policies: which optimizer-state subgroups are updated where.

A *policy* is a small immutable value chosen by the user (`AllHost()`, `Stride(2)`, ...).
Given the shape of the packed state (a `SubgroupSpec`) it produces a `Plan`: the
subgroups updated on the device, in the order they are streamed, and those updated
on the host. Plans are hashable so that a jitted step can take one as a static
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
  """

  num_subgroups: int
  subgroup_size: int
  num_elements: int
  state_bytes_per_element: int = 12
  param_bytes_per_element: int = 4
  grad_bytes_per_element: int = 4


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each subgroup is updated in one step.

  Attributes:
    device: subgroup indices streamed host -> device, updated there and streamed
      back, in this order.
    host: subgroup indices updated in host memory by the host path, in this order.
    resident: keep the whole state in device memory (the no-offload baseline);
      `device` then lists every subgroup and nothing is streamed.
    buffers: device subgroups in flight at once (double buffering = 2); bounds the
      device memory the streamed path needs to `buffers` subgroups of state.
  """

  device: tuple[int, ...]
  host: tuple[int, ...]
  resident: bool = False
  buffers: int = 2

  def __post_init__(self):
    everything = sorted(self.device + self.host)
    if everything != list(range(len(everything))):
      raise ValueError(
          f'Plan must name every subgroup exactly once; got device={self.device},'
          f' host={self.host}'
      )
    if self.resident and self.host:
      raise ValueError('A resident plan keeps every subgroup on the device.')
    if self.buffers < 1:
      raise ValueError(f'Plan.buffers must be >= 1, got {self.buffers}')

  @property
  def num_subgroups(self) -> int:
    return len(self.device) + len(self.host)

  def describe(self) -> str:
    """One line: how many subgroups go where."""
    if self.resident:
      return f'{self.num_subgroups} subgroups resident on device'
    return (
        f'{len(self.device)}/{self.num_subgroups} subgroups streamed to device'
        f' ({self.buffers} in flight), {len(self.host)} updated on host'
    )


@runtime_checkable
class Policy(Protocol):
  """Anything that turns a `SubgroupSpec` into a `Plan`."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    ...


def _checked_count(spec: SubgroupSpec) -> int:
  if spec.num_subgroups < 1:
    raise ValueError(f'num_subgroups must be >= 1, got {spec.num_subgroups}')
  return spec.num_subgroups


@dataclasses.dataclass(frozen=True)
class AllHost:
  """Every subgroup updated on the host: the ZeRO-Offload baseline."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    return Plan(device=(), host=tuple(range(_checked_count(spec))))


@dataclasses.dataclass(frozen=True)
class AllDevice:
  """State kept in device memory and updated there: the no-offload baseline."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    return Plan(device=tuple(range(_checked_count(spec))), host=(), resident=True)


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
    device = tuple(i for i in range(n) if i % self.k == 0)
    host = tuple(i for i in range(n) if i % self.k != 0)
    return Plan(device=device, host=host, buffers=self.buffers)


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
    # Spread the device subgroups evenly: subgroup i goes to the device when the
    # running share floor((i+1)*count/n) steps up.
    device = tuple(
        i for i in range(n) if math.floor((i + 1) * count / n) > math.floor(i * count / n)
    )
    host = tuple(i for i in range(n) if i not in set(device))
    return Plan(device=device, host=host, buffers=self.buffers)
