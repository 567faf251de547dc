"""`Auto`: the placement policy that asks the cost model, and re-plans when it was wrong.

`choose` predicts every plan of a small fixed candidate set (device fractions on a
grid, the paper's strides, two orders, 1-3 buffers: at most 294 plans) and keeps
the fastest one that fits the device-memory budget. Because the set is fixed per
`SubgroupSpec`, a run compiles at most that many distinct plans, however often `Auto`
changes its mind.

`Auto.observe` compares measured update times with the prediction. After `patience`
consecutive steps that depart from it by more than `tolerance`, it finds the smallest
single correction of the profile (host AdamW throughput, or the device stream's
throughput) that explains the measurement, and chooses again under the corrected
profile.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from dos_jax import costmodel
from dos_jax.costmodel import HardwareProfile
from dos_jax.costmodel import Prediction
from dos_jax.policies import DeviceFraction
from dos_jax.policies import Plan
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec

# Device fractions Auto considers: every device-subgroup count up to this many
# subgroups, a 1/40 grid of fractions beyond, so at most 41 counts (plus the strides').
EVERY_COUNT_UP_TO = 40
FRACTION_GRID: tuple[float, ...] = tuple(i / 40 for i in range(41))
# The paper's strides, so that Auto never does worse than a hand-tuned Stride(k).
STRIDES: tuple[int, ...] = tuple(range(1, 9))
BUFFER_CHOICES: tuple[int, ...] = (1, 2, 3)


def _first(count: int, n: int, buffers: int) -> Plan:
  """The first `count` subgroups streamed to the device, the rest on the host."""
  return Plan(device=tuple(range(count)), host=tuple(range(count, n)), buffers=buffers)


def candidates(
    spec: SubgroupSpec,
    *,
    fractions: tuple[float, ...] = FRACTION_GRID,
    strides: tuple[int, ...] = STRIDES,
    buffers: tuple[int, ...] = BUFFER_CHOICES,
    resident: bool = False,
) -> list[Plan]:
  """The bounded set of plans Auto chooses from, without duplicates, in a fixed order
  (ties in predicted time go to the earlier plan: spread before first, fewer buffers
  first). `resident` adds the AllDevice plan, whose state stays in device memory
  through the forward and backward passes too, so only a caller that knows the
  memory left beside the activations can judge whether it fits."""
  n = spec.num_subgroups
  if n <= EVERY_COUNT_UP_TO:
    fractions = tuple(c / n for c in range(n + 1))
  seen: dict[Plan, None] = {}
  for b in buffers:
    for f in fractions:
      spread = DeviceFraction(f, buffers=b).plan(spec)
      seen.setdefault(spread, None)
      seen.setdefault(_first(len(spread.device), n, b), None)
    for k in strides:
      stride = Stride(k, buffers=b).plan(spec)
      seen.setdefault(stride, None)
      seen.setdefault(_first(len(stride.device), n, b), None)
  # With nothing on the device, the buffer count is meaningless: keep one AllHost plan.
  out = [p for p in seen if p.device or p.buffers == buffers[0]]
  if resident:
    out.append(Plan(device=tuple(range(n)), host=(), resident=True))
  return out


@dataclasses.dataclass(frozen=True)
class Choice:
  """One candidate as `choose` saw it."""

  plan: Plan
  prediction: Prediction
  fits: bool


def rank(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    budget_bytes: float,
    *,
    backward_seconds: float = 0.0,
    plans: list[Plan] | None = None,
) -> list[Choice]:
  """Every candidate with its prediction, the fitting ones first, fastest first."""
  plans = candidates(spec) if plans is None else plans
  choices = [
      Choice(p, pred, pred.device_peak_bytes <= budget_bytes)
      for p in plans
      for pred in [costmodel.predict(profile, spec, p, backward_seconds=backward_seconds)]
  ]
  order = {id(c): i for i, c in enumerate(choices)}
  return sorted(
      choices,
      key=lambda c: (not c.fits, c.prediction.update_seconds, c.prediction.device_peak_bytes, order[id(c)]),
  )


def choose(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    budget_bytes: float | None = None,
    *,
    backward_seconds: float = 0.0,
) -> tuple[Plan, Prediction]:
  """The fastest candidate plan whose device memory fits `budget_bytes` (default: the
  profile's free device memory). AllHost needs no device memory, so one always fits."""
  budget = profile.device_free_bytes if budget_bytes is None else budget_bytes
  best = rank(profile, spec, budget, backward_seconds=backward_seconds)[0]
  return best.plan, best.prediction


def _solve_scale(predict_at, target: float) -> float | None:
  """The factor x with predict_at(x) == target (predict_at falls as x grows), by
  bisection on log x over [1e-3, 1e3]; None when no factor in range reaches it."""
  lo, hi = math.log(1e-3), math.log(1e3)
  if not predict_at(math.exp(hi)) <= target <= predict_at(math.exp(lo)):
    return None
  for _ in range(60):
    mid = (lo + hi) / 2
    if predict_at(math.exp(mid)) > target:
      lo = mid
    else:
      hi = mid
  return math.exp((lo + hi) / 2)


def fit_correction(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    measured_seconds: float,
    *,
    backward_seconds: float = 0.0,
) -> tuple[HardwareProfile, str]:
  """The profile corrected by one factor, on the host AdamW or on the device stream,
  under which `plan` is predicted to take `measured_seconds`: the factor on what bounds
  the prediction when that alone can explain the measurement, else the smallest one.

  Returns the corrected profile and a one-line reason. When neither factor can
  explain the measurement alone, both are scaled by the overall ratio.
  """
  def at(**scale):
    return lambda x: costmodel.predict(
        profile.scaled(**{k: x for k in scale}), spec, plan, backward_seconds=backward_seconds
    ).update_seconds

  options = []
  pred = costmodel.predict(profile, spec, plan, backward_seconds=backward_seconds)
  if plan.host:
    x = _solve_scale(at(host=1), measured_seconds)
    if x is not None:
      options.append((abs(math.log(x)), 'host', x))
  if plan.device:
    x = _solve_scale(at(stream=1), measured_seconds)
    if x is not None:
      options.append((abs(math.log(x)), 'stream', x))
  bound = {'host': 'host', 'device stream': 'stream', 'H2D link': 'stream', 'D2H link': 'stream'}
  preferred = [o for o in options if o[1] == bound.get(pred.bound)]
  if preferred:  # what limits the prediction is the likeliest to be off
    _, which, x = preferred[0]
  elif options:
    _, which, x = min(options)
  else:
    which, x = 'both', pred.update_seconds / measured_seconds
  scale = {'host': x, 'stream': x} if which == 'both' else {which: x}
  label = {'host': 'host AdamW', 'stream': 'device stream', 'both': 'host and device'}[which]
  reason = (
      f'{plan.describe()}: measured {measured_seconds:.4g}s vs predicted'
      f' {pred.update_seconds:.4g}s; {label} throughput x{x:.3g}'
  )
  return profile.scaled(**scale, name=profile.name), reason


class Auto:
  """Placement by the cost model: the fastest plan that fits, re-chosen when measured
  step times keep departing from the prediction.

  Satisfies the `Policy` protocol (`plan(spec) -> Plan`). The runner passes each
  step's update time to `observe`, which returns the plan to use next.
  """

  def __init__(
      self,
      profile: HardwareProfile | None = None,
      *,
      budget_bytes: float | None = None,
      backward_seconds: float = 0.0,
      tolerance: float = 0.15,
      patience: int = 3,
      warmup: int = 1,
  ):
    """Args:
      profile: the machine; None calibrates this one on first use (cached as JSON).
      budget_bytes: device memory the streamed buffers may use; default: the
        profile's free device memory.
      backward_seconds: the backward pass's length, behind which host gradient
        copies hide.
      tolerance: relative departure of a measurement from its prediction that counts.
      patience: consecutive departing steps before re-planning.
      warmup: observations ignored after each change of plan (they include compiling).
    """
    if not 0 < tolerance < 10:
      raise ValueError(f'Auto.tolerance must be in (0, 10), got {tolerance!r}')
    if not isinstance(patience, int) or patience < 1:
      raise ValueError(f'Auto.patience must be an integer >= 1, got {patience!r}')
    if not isinstance(warmup, int) or warmup < 0:
      raise ValueError(f'Auto.warmup must be an integer >= 0, got {warmup!r}')
    self._profile = profile
    self.budget_bytes = budget_bytes
    self.backward_seconds = backward_seconds
    self.tolerance = tolerance
    self.patience = patience
    self.warmup = warmup
    self.spec: SubgroupSpec | None = None
    self.current: Plan | None = None
    self.ranking: list[Choice] = []
    self.corrections: list[str] = []
    self.replans = 0
    self._departures: list[float] = []
    self._skip = warmup

  def __repr__(self):
    name = self._profile.name if self._profile else 'this machine (lazy)'
    return f'Auto(profile={name}, tolerance={self.tolerance}, patience={self.patience})'

  @property
  def profile(self) -> HardwareProfile:
    if self._profile is None:
      from dos_jax import calibrate  # pylint: disable=import-outside-toplevel
      self._profile = calibrate.cached_profile()
    return self._profile

  @property
  def prediction(self) -> Prediction | None:
    """The prediction of the current plan."""
    for c in self.ranking:
      if c.plan == self.current:
        return c.prediction
    return None

  def _choose(self) -> Plan:
    budget = self.profile.device_free_bytes if self.budget_bytes is None else self.budget_bytes
    self.ranking = rank(self.profile, self.spec, budget, backward_seconds=self.backward_seconds)
    new = self.ranking[0].plan
    if new != self.current:
      self._skip = self.warmup
    self.current = new
    self._departures = []
    return new

  def plan(self, spec: SubgroupSpec) -> Plan:
    if spec != self.spec or self.current is None:
      self.spec = spec
      self.current = None
      return self._choose()
    return self.current

  def observe(self, plan: Plan, measured_update_seconds: float) -> Plan:
    """Records one step's measured update time under `plan`; returns the plan for the
    next step (the same one unless `patience` steps in a row departed by more than
    `tolerance` from the prediction)."""
    if self.spec is None:
      raise ValueError('Auto.observe called before Auto.plan(spec)')
    if not (math.isfinite(measured_update_seconds) and measured_update_seconds > 0):
      raise ValueError(f'measured_update_seconds must be positive, got {measured_update_seconds!r}')
    if self._skip > 0:
      self._skip -= 1
      return self.current
    predicted = costmodel.predict(
        self.profile, self.spec, plan, backward_seconds=self.backward_seconds
    ).update_seconds
    if abs(measured_update_seconds - predicted) <= self.tolerance * predicted:
      self._departures = []
      return self.current
    self._departures.append(measured_update_seconds)
    if len(self._departures) < self.patience:
      return self.current
    measured = statistics.median(self._departures)
    self._profile, reason = fit_correction(
        self.profile, self.spec, plan, measured, backward_seconds=self.backward_seconds
    )
    self.corrections.append(reason)
    self.replans += 1
    return self._choose()

  def explain(self, top: int = 5) -> str:
    """Why the current plan: the candidates compared, the best few, some baselines."""
    if self.spec is None:
      return 'Auto has not planned yet (call plan(spec) first).'
    from dos_jax import report  # pylint: disable=import-outside-toplevel
    return report.explain_choice(
        self.profile, self.spec, self.ranking, self.current, corrections=self.corrections,
        top=top, backward_seconds=self.backward_seconds,
    )
