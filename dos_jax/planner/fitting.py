"""Correcting a `HardwareProfile` from measured update times, as `Auto` re-plans.

One measured plan gives one equation, so it can fix one factor: the host AdamW's
throughput or the device stream's (`corrections` lists each that explains the
measurement alone). Several measured plans fix both at once (`fit_joint`, least
squares on log times).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from dos_jax.planner import costmodel
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_LABEL = {'host': 'host AdamW', 'stream': 'device stream', 'both': 'host and device'}
# Which factor to suspect first, by what bounds the prediction.
_SUSPECT = {'host': 'host', 'device stream': 'stream', 'H2D link': 'stream', 'D2H link': 'stream',
            'resident': 'stream'}


# Weight of the pull toward the profile's own factors in `fit_joint`: small beside a
# misfit of a few percent (0.05^2 = 2.5e-3), decisive where the misfit is flat.
_PULL = 1e-4


@dataclasses.dataclass(frozen=True)
class Correction:
  """A profile corrected by factors on the host AdamW and device-stream throughputs."""

  profile: HardwareProfile
  host: float
  stream: float
  reason: str


def solve_scale(predict_at, target: float) -> float | None:
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


def corrections(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    measured_seconds: float,
    *,
    backward_seconds: float = 0.0,
) -> list[Correction]:
  """Every single-factor correction under which `plan` is predicted to take
  `measured_seconds`, the likeliest first (the factor on what bounds the prediction,
  then the smallest change). When no single factor explains it, both are scaled by the
  overall ratio."""
  pred = costmodel.predict(profile, spec, plan, backward_seconds=backward_seconds)

  def at(which):
    return lambda x: costmodel.predict(
        profile.scaled(**{which: x}), spec, plan, backward_seconds=backward_seconds
    ).update_seconds

  options = []
  for which, used in (('host', plan.host), ('stream', plan.streamed)):
    x = solve_scale(at(which), measured_seconds) if used else None
    if x is not None:
      options.append((which != _SUSPECT.get(pred.bound), abs(math.log(x)), which, x))
  if not options:
    options = [(False, 0.0, 'both', pred.update_seconds / measured_seconds)]
  out = []
  for _, _, which, x in sorted(options):
    host, stream = (x if which in ('host', 'both') else 1.0), (x if which in ('stream', 'both') else 1.0)
    reason = (
        f'{plan.describe()}: measured {measured_seconds:.4g}s vs predicted'
        f' {pred.update_seconds:.4g}s; {_LABEL[which]} throughput x{x:.3g}'
    )
    out.append(Correction(profile.scaled(host=host, stream=stream), host, stream, reason))
  return out


def fit_correction(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    measured_seconds: float,
    *,
    backward_seconds: float = 0.0,
) -> tuple[HardwareProfile, str]:
  """The likeliest single-factor correction: (corrected profile, one-line reason)."""
  best = corrections(profile, spec, plan, measured_seconds, backward_seconds=backward_seconds)[0]
  return best.profile, best.reason


def fit_joint(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    measured: Mapping[Plan, float],
    *,
    backward_seconds: float = 0.0,
) -> Correction:
  """Host and device-stream factors that best explain several measured plans: least
  squares on log times, over factors in [1e-3, 1e3]. A small
  pull toward 1 keeps a factor the measurements cannot see (say, the host's, when every
  measured plan was bound by the device stream) where the profile had it."""

  def loss(log_host, log_stream):
    scaled = profile.scaled(host=math.exp(log_host), stream=math.exp(log_stream))
    misfit = sum(
        (math.log(costmodel.predict(scaled, spec, p, backward_seconds=backward_seconds).update_seconds)
         - math.log(t)) ** 2
        for p, t in measured.items()
    )
    return misfit + _PULL * (log_host ** 2 + log_stream ** 2)

  # Coordinate descent from the profile's own factors: each factor in turn minimized
  # over a dense grid, then refined by golden section around the best grid point.
  center = [0.0, 0.0]
  span = math.log(1e3)
  for _ in range(3):
    for axis in (0, 1):
      def along(v, axis=axis):
        return loss(*(v if i == axis else center[i] for i in (0, 1)))
      grid = [-span + 2 * span * i / 40 for i in range(41)]
      best = min(grid, key=along)
      lo, hi = best - 2 * span / 40, best + 2 * span / 40
      for _ in range(25):
        m1, m2 = hi - (hi - lo) * 0.618, lo + (hi - lo) * 0.618
        if along(m1) <= along(m2):
          hi = m2
        else:
          lo = m1
      center[axis] = min((best, (lo + hi) / 2), key=along)
  host, stream = math.exp(center[0]), math.exp(center[1])
  reason = (
      f'{len(measured)} measured plans: host AdamW throughput x{host:.3g}, device stream x{stream:.3g}'
      f' (rms log error {math.sqrt(loss(*center) / len(measured)):.3f})'
  )
  return Correction(profile.scaled(host=host, stream=stream), host, stream, reason)
