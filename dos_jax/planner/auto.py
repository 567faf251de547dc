"""`Auto`: the placement policy that asks the cost model, and re-plans when it was wrong.

`choose` predicts every plan of a small fixed candidate set and keeps the fastest one
that fits the device-memory budget. Each candidate places every subgroup in one of three
tiers: the first r subgroups resident in device memory (r from `resident_counts`: none,
the most that fit beside the activations, a few steps between), and the rest split
between streamed and host (device fractions on a grid, the paper's strides, two orders,
1-3 buffers: at most 294 splits per r). Because the set is fixed per `SubgroupSpec` and
budget, a run compiles at most that many distinct plans, however often `Auto` changes
its mind; a change of plan moves rows between tiers once (`costmodel.migration`, shown
in the next `StepRecord`).

`Auto.observe` compares measured update times with the prediction (`wants_measurement`
tells a runner that times only some steps when Auto needs the next one). After `patience`
consecutive steps that depart from it by more than `tolerance`, it corrects the profile
(`fitting`) and chooses again. With one plan measured, one factor (host AdamW or
device stream throughput) explains the measurement; when the two explanations would
choose different plans, Auto tries the plan that changes, whose measurement then tells
them apart. With several plans measured, both factors are fitted together.
A resource faster than believed shows only when it is on the critical path of the plan
being run: Auto does not spend steps on plans it predicts to be slower.

`dos-jax plan` chooses with an `Auto` too (the same `rank`, the same inputs: budget,
activations, backward pass and `last_grad_bytes`), so the plan it prints is the one the
runner's `Auto` takes. In a multi-process run every choice goes through an agreement
(`Auto.agree`, `dos_jax.train.agree`): process 0's profile and plans, and measurements
reduced over the processes, so that every process traces the same program.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from dos_jax.planner import costmodel
from dos_jax.planner import disk
from dos_jax.planner import fitting
from dos_jax.planner import timeline
from dos_jax.planner.costmodel import HardwareProfile
from dos_jax.planner.costmodel import Prediction
from dos_jax.policies import DeviceFraction
from dos_jax.policies import Plan
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec

# Measured plans kept for the joint fit: the most recent ones.
_MEMORY = 4
# Device fractions Auto considers: every device-subgroup count up to this many
# subgroups, a 1/40 grid of fractions beyond, so at most 41 counts (plus the strides').
EVERY_COUNT_UP_TO = 40
FRACTION_GRID: tuple[float, ...] = tuple(i / 40 for i in range(41))
# The paper's strides, so that Auto never does worse than a hand-tuned Stride(k).
STRIDES: tuple[int, ...] = tuple(range(1, 9))
BUFFER_CHOICES: tuple[int, ...] = (1, 2, 3)


def _first(count: int, n: int, buffers: int) -> Plan:
  """The first `count` subgroups streamed to the device, the rest on the host."""
  return Plan(streamed=tuple(range(count)), host=tuple(range(count, n)), buffers=buffers)


def resident_counts(spec: SubgroupSpec, budget_bytes: float,
                    activation_bytes: float = 0.0) -> tuple[int, ...]:
  """How many subgroups Auto tries keeping resident: none, the most whose state fits
  in `budget_bytes` beside the activations, the few below that (leaving room for 1-3
  streamed buffers when those outgrow the activations) and quarter steps between.
  At most 9 counts, fixed for a given spec and budget."""
  per = float(spec.state_bytes_per_element * spec.subgroup_size)
  room = budget_bytes - max(activation_bytes, 0.0)
  most = 0 if room < per else min(spec.num_subgroups, int(room // per))
  counts = {0, most} | {max(0, most - b) for b in BUFFER_CHOICES}
  counts |= {int(round(most * q)) for q in (0.25, 0.5, 0.75)}
  return tuple(sorted(counts))


def _shifted(plan: Plan, resident: int) -> Plan:
  """`plan` over the subgroups after the first `resident`, which stay resident."""
  shift = lambda ids: tuple(resident + i for i in ids)
  return Plan(streamed=shift(plan.streamed), host=shift(plan.host),
              resident=tuple(range(resident)), buffers=plan.buffers)


def candidates(
    spec: SubgroupSpec,
    *,
    fractions: tuple[float, ...] = FRACTION_GRID,
    strides: tuple[int, ...] = STRIDES,
    buffers: tuple[int, ...] = BUFFER_CHOICES,
    resident: tuple[int, ...] = (0,),
) -> list[Plan]:
  """The bounded set of plans Auto chooses from, without duplicates, in a fixed order
  (ties in predicted time go to the earlier plan: fewer resident, spread before first,
  fewer buffers first). For each count in `resident` (see `resident_counts`), the
  first that many subgroups stay resident and the streamed/host candidates cover the
  rest; a count equal to the subgroup count is the AllDevice plan. A resident tier
  stays in device memory through the forward and backward passes too, so only a
  caller that knows the memory left beside the activations can judge whether it fits."""
  n = spec.num_subgroups
  out: list[Plan] = []
  for r in sorted(set(resident)):
    if not 0 <= r <= n:
      raise ValueError(f'resident count {r} outside 0..{n}')
    if r == n:
      out.append(Plan(streamed=(), host=(), resident=tuple(range(n))))
      continue
    rest = spec if r == 0 else dataclasses.replace(
        spec, num_subgroups=n - r, num_elements=min(spec.num_elements, (n - r) * spec.subgroup_size))
    base = _streamed_candidates(rest, fractions=fractions, strides=strides, buffers=buffers)
    out += base if r == 0 else [_shifted(p, r) for p in base]
  return out


def _streamed_candidates(spec: SubgroupSpec, *, fractions, strides, buffers) -> list[Plan]:
  """Streamed/host splits of every subgroup: fractions, strides, both orders."""
  n = spec.num_subgroups
  if n <= EVERY_COUNT_UP_TO:
    fractions = tuple(c / n for c in range(n + 1))
  seen: dict[Plan, None] = {}
  for b in buffers:
    for f in fractions:
      spread = DeviceFraction(f, buffers=b).plan(spec)
      seen.setdefault(spread, None)
      seen.setdefault(_first(len(spread.streamed), n, b), None)
    for k in strides:
      stride = Stride(k, buffers=b).plan(spec)
      seen.setdefault(stride, None)
      seen.setdefault(_first(len(stride.streamed), n, b), None)
  # With nothing on the device, the buffer count is meaningless: keep one AllHost plan.
  return [p for p in seen if p.streamed or p.buffers == buffers[0]]


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
    activation_bytes: float = 0.0,
    resident: bool = True,
    last_grad_bytes: float = 0.0,
    host_memory_bytes: float | None = None,
) -> list[Choice]:
  """Every candidate with its prediction, the fitting ones first, fastest first.

  A plan fits when its resident state plus the larger of `activation_bytes` and its
  streamed buffers stays within `budget_bytes` (device memory beyond params and grads).
  `resident` adds plans that keep subgroups resident (see `resident_counts`).
  `last_grad_bytes`: the gradient made last, never hidden (`costmodel.predict`).
  `host_memory_bytes`: host memory per device for the optimizer; the host subgroups
  beyond it go to disk, and a plan fits only where it holds the rest (`disk`)."""
  if plans is None:
    counts = resident_counts(spec, budget_bytes, activation_bytes) if resident else (0,)
    plans = candidates(spec, resident=counts)
  def choice(p: Plan) -> Choice:
    pred = disk.predict(profile, spec, p, backward_seconds=backward_seconds,
                        last_grad_bytes=last_grad_bytes, host_memory_bytes=host_memory_bytes)
    return Choice(p, pred, pred.device_bytes_beside(activation_bytes) <= budget_bytes
                  and disk.host_fits(profile, spec, p, host_memory_bytes))
  choices = [choice(p) for p in plans]
  order = {id(c): i for i, c in enumerate(choices)}
  return sorted(choices, key=lambda c: (not c.fits, c.prediction.update_seconds,
                                        c.prediction.device_peak_bytes, order[id(c)]))


def choose(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    budget_bytes: float | None = None,
    *,
    backward_seconds: float = 0.0,
    activation_bytes: float = 0.0,
) -> tuple[Plan, Prediction]:
  """The fastest candidate plan whose device memory fits `budget_bytes` beside
  `activation_bytes` (see `rank`). Given a budget (device memory beyond params and
  grads), resident plans compete too; without one, the profile's free device memory
  bounds the streamed buffers only. AllHost needs no device memory, so one always fits."""
  budget = profile.device_free_bytes if budget_bytes is None else budget_bytes
  best = rank(profile, spec, budget, backward_seconds=backward_seconds,
              activation_bytes=activation_bytes, resident=budget_bytes is not None)[0]
  return best.plan, best.prediction


def last_grad_bytes(vocab_size: int, dim: int, param_bytes: int, devices: int) -> float:
  """The gradient the runner's backward pass makes last, per device: the input
  embedding's (vocab x dim), sharded over `devices`. What `dos-jax plan` and the runner
  give `Auto(last_grad_bytes=...)`."""
  return vocab_size * dim * param_bytes / max(devices, 1)


class Auto:
  """Placement by the cost model: the fastest plan that fits, re-chosen when measured
  step times keep departing from the prediction.

  Satisfies the `Policy` protocol (`plan(spec) -> Plan`). The runner passes each
  step's update time to `observe`, which returns the plan to use next. A jitted step
  consults the policy only while it is traced, so pass that plan to the transform's
  `update(..., plan=plan)` as a static argument: each distinct plan compiles once.
  """

  def __init__(
      self,
      profile: HardwareProfile | None = None,
      *,
      budget_bytes: float | None = None,
      activation_bytes: float = 0.0,
      backward_seconds: float = 0.0,
      clip_rate: float = 0.1,
      tolerance: float = 0.15,
      patience: int = 3,
      warmup: int = 1,
      last_grad_bytes: float = 0.0,
      host_memory_bytes: float | None = None,
  ):
    """Args:
      profile: the machine; None calibrates this one on first use (cached as JSON).
      budget_bytes: device memory free beyond the model's params and grads, less a
        safety margin (`planner.memory.device_budget`). Given, Auto also keeps as many
        subgroups resident as fit beside the activations; None: the profile's free
        device memory bounds the streamed buffers only, and nothing stays resident
        (Auto cannot know what the model itself takes).
      activation_bytes: device memory the forward and backward passes need beside
        params and grads; a resident tier must leave room for it.
      backward_seconds: the backward pass's length, behind which host gradient
        copies hide (and early host calls run: `early_calls`).
      clip_rate: the fraction of steps whose clip factor is not 1, which early host
        chunks redo; `observe_rollbacks` replaces it with the measured one.
      tolerance: relative departure of a measurement from its prediction that counts.
      patience: consecutive departing steps before re-planning.
      warmup: observations ignored after each change of plan (they include compiling).
      last_grad_bytes: bytes of the gradient the backward pass makes last, whose copy
        nothing hides (`costmodel.predict`; `last_grad_bytes` below gives the runner's).
      host_memory_bytes: host memory per device for the optimizer, beyond it disk (`rank`).
    """
    if not 0 < tolerance < 10:
      raise ValueError(f'Auto.tolerance must be in (0, 10), got {tolerance!r}')
    if not isinstance(patience, int) or patience < 1:
      raise ValueError(f'Auto.patience must be an integer >= 1, got {patience!r}')
    if not isinstance(warmup, int) or warmup < 0:
      raise ValueError(f'Auto.warmup must be an integer >= 0, got {warmup!r}')
    self._profile = profile
    self.budget_bytes = budget_bytes
    self.activation_bytes = activation_bytes
    self.last_migration: costmodel.Migration | None = None
    self.backward_seconds = backward_seconds
    if not 0.0 <= clip_rate <= 1.0:
      raise ValueError(f'Auto.clip_rate must be in [0, 1], got {clip_rate!r}')
    self.clip_rate = clip_rate
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
    self._confirmed = False
    self._base: HardwareProfile | None = profile
    self._measured: dict[Plan, float] = {}
    if not (math.isfinite(last_grad_bytes) and last_grad_bytes >= 0):
      raise ValueError(f'Auto.last_grad_bytes must be >= 0, got {last_grad_bytes!r}')
    self.last_grad_bytes = last_grad_bytes
    self.host_memory_bytes = host_memory_bytes
    # Several processes: what takes every choice alike on each (`agree`), and this
    # process's own profile where it differs from the agreed one.
    self.agreement = None
    self._own: HardwareProfile | None = None

  def agree(self, agreement) -> None:
    """Takes every program-shaping choice through `agreement`, so that the processes of
    one run choose alike (`dos_jax.train.agree.Agreement`, or any object with its
    methods): `profile(own) -> (shared, own)` gives process 0's profile for this one's
    (None: not calibrated yet), `plan(plan, own=...)` process 0's plan, logging where
    this process (or its own profile) would have chosen another, and `seconds(x)`,
    `counts(rollbacks, steps)` the measurements reduced over the processes. A collective:
    every process calls it at the same point, before `plan`."""
    shared, own = agreement.profile(self._profile)
    self._own = own if own is not None and own != shared else None
    self._profile = self._base = shared
    self.agreement = agreement

  def __repr__(self):
    name = self._profile.name if self._profile else 'this machine (lazy)'
    return f'Auto(profile={name}, tolerance={self.tolerance}, patience={self.patience})'

  @property
  def profile(self) -> HardwareProfile:
    if self._profile is None:
      from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
      self._profile = self._base = calibrate.cached_profile()
    return self._profile

  @property
  def prediction(self) -> Prediction | None:
    """The prediction of the current plan."""
    for c in self.ranking:
      if c.plan == self.current:
        return c.prediction
    return None

  def _rank(self, profile: HardwareProfile) -> list[Choice]:
    budget = profile.device_free_bytes if self.budget_bytes is None else self.budget_bytes
    return rank(profile, self.spec, budget, backward_seconds=self.backward_seconds,
                activation_bytes=self.activation_bytes, resident=self.budget_bytes is not None,
                last_grad_bytes=self.last_grad_bytes, host_memory_bytes=self.host_memory_bytes)

  def _predict(self, plan: Plan) -> Prediction:
    return disk.predict(self.profile, self.spec, plan, backward_seconds=self.backward_seconds,
                        last_grad_bytes=self.last_grad_bytes,
                        host_memory_bytes=self.host_memory_bytes)

  def _choose(self, ranking: list[Choice] | None = None) -> Plan:
    self.ranking = ranking or self._rank(self.profile)
    new = self.ranking[0].plan
    if self.agreement is not None:  # process 0's plan, the same on every process
      own = (self._rank(self._own)[0].plan
             if self.current is None and self._own is not None else None)
      new = self.agreement.plan(new, own=own)
    if new != self.current:
      self._skip = self.warmup
      if self.current is not None:
        self.last_migration = costmodel.migration(self.profile, self.spec, self.current, new)
    self.current = new
    self._departures = []
    self._confirmed = False
    return new

  def early_calls(self, spec: SubgroupSpec, plan: Plan) -> tuple[int, ...] | None:
    """The early host calls of `plan` (`Partition.early`): a `timeline.EarlyChooser`
    with this profile, `backward_seconds` and `clip_rate`; None without a backward-pass
    time to weigh them against (the state then takes the fixed rule,
    `partition.early_host_calls`)."""
    if self.backward_seconds <= 0:
      return None
    return timeline.EarlyChooser(
        self.profile,
        backward_seconds=self.backward_seconds, clip_rate=self.clip_rate,
    ).early_calls(spec, plan)

  def observe_rollbacks(self, rollbacks: int, steps: int) -> None:
    """Takes the clip rate measured over `steps` steps (`rollbacks` of them had a clip
    factor other than 1) for the next choice of `early_calls`."""
    if self.agreement is not None:
      rollbacks, steps = self.agreement.counts(rollbacks, steps)
    if steps > 0 and 0 <= rollbacks <= steps:
      self.clip_rate = rollbacks / steps

  def plan(self, spec: SubgroupSpec) -> Plan:
    if spec != self.spec or self.current is None:
      self.spec = spec
      self.current = None
      self._measured = {}
      return self._choose()
    return self.current

  def observe(self, plan: Plan, measured_update_seconds: float) -> Plan:
    """Records one step's measured update time under `plan`; returns the plan for the
    next step (the same one unless `patience` steps in a row departed by more than
    `tolerance` from the prediction)."""
    if self.spec is None:
      raise ValueError('Auto.observe called before Auto.plan(spec)')
    if self.agreement is not None:  # the slowest process's time, on every process
      measured_update_seconds = self.agreement.seconds(measured_update_seconds)
    if not (math.isfinite(measured_update_seconds) and measured_update_seconds > 0):
      raise ValueError(f'measured_update_seconds must be positive, got {measured_update_seconds!r}')
    if self._skip > 0:
      self._skip -= 1
      return self.current
    predicted = self._predict(plan).update_seconds
    self._remember(plan, measured_update_seconds)
    if abs(measured_update_seconds - predicted) <= self.tolerance * predicted:
      self._departures = []
      self._confirmed = True
      return self.current
    self._departures.append(measured_update_seconds)
    if len(self._departures) < self.patience:
      return self.current
    self._remember(plan, statistics.median(self._departures))
    if len(self._measured) >= 2:
      options = [fitting.fit_joint(
          self._base, self.spec, self._measured, backward_seconds=self.backward_seconds
      )]
    else:
      options = fitting.corrections(
          self.profile, self.spec, plan, self._measured[plan],
          backward_seconds=self.backward_seconds,
      )
    ranked = [(c, self._rank(c.profile)) for c in options]
    # The likeliest explanation, unless another would move to a different plan: trying
    # that plan is what tells the two explanations apart.
    pick = next((r for r in ranked if r[1][0].plan != self.current), ranked[0])
    if len({r[1][0].plan for r in ranked}) == 1:
      pick = ranked[0]
    self._profile = pick[0].profile
    self.corrections.append(pick[0].reason)
    self.replans += 1
    return self._choose(pick[1])

  def wants_measurement(self) -> bool:
    """Whether Auto needs the next step's update time now.

    True while the current plan (or the profile's latest correction) is unconfirmed:
    observations still to skip after a change, no measurement yet within `tolerance`
    of the prediction, or a run of departures under way. A runner that times the
    update phase only now and then (timing it means running the update as a program
    of its own, which costs overlap) asks before every step: consecutive measurements
    while Auto is deciding, occasional ones once its plan is confirmed.
    """
    return self.spec is not None and (
        self._skip > 0 or not self._confirmed or bool(self._departures))

  def _remember(self, plan: Plan, seconds: float) -> None:
    self._measured.pop(plan, None)
    self._measured[plan] = seconds
    while len(self._measured) > _MEMORY:
      del self._measured[next(iter(self._measured))]

  def record(self, step: int, measured_update_seconds: float | None = None):
    """A `report.StepRecord` of the current plan at `step`, for the metrics log."""
    from dos_jax.planner import report  # pylint: disable=import-outside-toplevel
    if self.spec is None or self.current is None:
      raise ValueError('Auto.record called before Auto.plan(spec)')
    prediction = self._predict(self.current)
    migration, self.last_migration = self.last_migration, None
    return report.StepRecord.of(step, self.current, prediction, measured_update_seconds,
                                migration=migration)

  def explain(self, top: int = 5) -> str:
    """Why the current plan: the candidates compared, the best few, some baselines."""
    if self.spec is None:
      return 'Auto has not planned yet (call plan(spec) first).'
    from dos_jax.planner import report  # pylint: disable=import-outside-toplevel
    return report.explain_choice(
        self.profile, self.spec, self.ranking, self.current, corrections=self.corrections,
        top=top, backward_seconds=self.backward_seconds,
    )
