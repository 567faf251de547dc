"""One decision, every process: the choices that shape the program, made once.

In a multi-process run every process must trace the same program, or the collectives
hang. What could differ is what each process measures: its calibrated
`HardwareProfile` (two hosts' memory bandwidths a few per cent apart can pick different
plans), its device memory, its step times. So:

* the profile: process 0's is broadcast (`multihost_utils.broadcast_one_to_all` on its
  JSON bytes); every decision derived from it (`Auto`'s plan and re-plans, its early
  host calls, a static policy's `EarlyChooser`) is then deterministic and alike;
* each plan `Auto` chooses: process 0's is broadcast and taken. A process whose own
  choice differs (its device memory gave another budget), or whose own calibrated
  profile would have chosen another plan, logs one line saying so;
* the measurements that feed a re-plan are reduced over the processes first: the
  update-phase time by the maximum (a data-parallel step is as slow as its slowest
  process), the clip-rate counts by the maximum too (they count steps whose global
  gradient norm reached the clip norm: the norm is one all-reduced value, so the counts
  agree anyway, and the reduction only makes it certain).

Every function here is a collective where it talks to the others: every process calls
it at the same point. One process: nothing is exchanged and nothing is calibrated
early (`shared_profile` returns None, `auto` does nothing).

The pinned-host pool (`dos_jax.pinned_pool`) needs no agreement: `dos-jax train`
sizes it from the config and the process count alone (every subgroup on the host, the
most any plan pins), the same on every process, before any backend starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, TextIO

import jax
import numpy as np

from dos_jax.planner.hardware import HardwareProfile
from dos_jax import Plan


def processes() -> int:
  return jax.process_count()


def _broadcast_bytes(data: bytes) -> bytes:
  """Process 0's `data`, on every process."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  size = multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32))
  buf = np.zeros(int(np.asarray(size)[0]), np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(data, np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes()


def _gather(values: list[float]) -> np.ndarray:
  """Every process's `values`, one row per process (float32, as the collectives carry)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  out = multihost_utils.process_allgather(np.asarray(values, np.float32))
  return np.asarray(out).reshape(processes(), len(values))


def _plan_text(plan: Plan) -> bytes:
  return json.dumps(dataclasses.asdict(plan), sort_keys=True).encode()


def _plan_of(text: bytes) -> Plan:
  fields = json.loads(text.decode())
  return Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _own_profile() -> HardwareProfile | None:
  """This process's profile: calibrated (or cached) on process 0, which decides; on the
  others the cached one if there is one (only to say when it would have chosen
  differently: they calibrate nothing)."""
  from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    return calibrate.cached_profile()
  path = calibrate.profile_path()
  if not os.path.exists(path):
    return None
  try:
    return calibrate.load_profile(path)
  except ValueError:
    return None


class Agreement:
  """Process 0's choices, taken by every process (`dos_jax.Auto.agree`)."""

  def __init__(self, stream: TextIO | None = None):
    self.rank = jax.process_index()
    self.stream = sys.stderr if stream is None else stream
    self.said: list[str] = []

  def _say(self, line: str) -> None:
    self.said.append(line)
    print(f'dos-jax: process {self.rank}: {line}', file=self.stream, flush=True)

  def profile(self, own: HardwareProfile | None
              ) -> tuple[HardwareProfile, HardwareProfile | None]:
    """(process 0's profile, this process's own or None). `own` None: calibrated or
    read from the cache here (`_own_profile`)."""
    if own is None:
      own = _own_profile()
    text = own.to_json().encode() if self.rank == 0 else b''
    shared = HardwareProfile.from_dict(json.loads(_broadcast_bytes(text).decode()),
                                       origin='process 0\'s profile')
    return shared, own

  def plan(self, plan: Plan, *, own: Plan | None = None) -> Plan:
    """Process 0's plan. `plan`: this process's choice from the shared profile; `own`:
    what its own profile would have chosen (None: not asked)."""
    shared = _plan_of(_broadcast_bytes(_plan_text(plan)))
    if plan != shared:
      self._say(f'chose {plan.describe()} from process 0\'s profile (its device memory'
                f' differs); takes process 0\'s plan {shared.describe()}')
    elif own is not None and own != shared:
      self._say(f'its own calibrated profile would have chosen {own.describe()}; takes'
                f' process 0\'s plan {shared.describe()}')
    return shared

  def seconds(self, value: float) -> float:
    """The largest of every process's `value` (a measured update-phase time)."""
    return float(np.max(_gather([value])))

  def counts(self, rollbacks: int, steps: int) -> tuple[int, int]:
    """The largest rollback and step counts over the processes."""
    top = np.max(_gather([rollbacks, steps]), axis=0)
    return int(top[0]), int(top[1])


def auto(policy: Any, stream: TextIO | None = None) -> Agreement | None:
  """Makes a `dos_jax.Auto` take its choices through an `Agreement` in a multi-process
  run (a collective: every process calls it while building the run); returns it.
  One process, or another policy: nothing, None."""
  from dos_jax.planner.auto import Auto  # pylint: disable=import-outside-toplevel
  if processes() == 1 or not isinstance(policy, Auto):
    return None
  agreement = Agreement(stream)
  policy.agree(agreement)
  return agreement


def shared_profile() -> HardwareProfile | None:
  """Process 0's profile in a multi-process run (a collective), for a chooser built
  outside `Auto` (`timeline.EarlyChooser`); None with one process (the chooser then
  calibrates this machine on first use, as before)."""
  if processes() == 1:
    return None
  return Agreement().profile(None)[0]


def max_counts(rollbacks: int, steps: int) -> tuple[int, int]:
  """The largest rollback and step counts over the processes (a collective); the counts
  themselves with one process."""
  if processes() == 1:
    return rollbacks, steps
  return Agreement().counts(rollbacks, steps)


def max_seconds(value: float) -> float:
  """The largest of every process's `value` (a collective); `value` with one process."""
  if processes() == 1:
    return value
  return Agreement().seconds(value)
