"""Per-step records of where the update went and how long it took, and their printing.

A `StepRecord` is what the runner logs every step (or every N): subgroups on host and
device, bytes moved each way, predicted and measured update time. `explain` turns
records, or an `Auto` policy, into a compact table a person can read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dos_jax.planner import costmodel
from dos_jax.planner.costmodel import HardwareProfile
from dos_jax.planner.costmodel import Prediction
from dos_jax.policies import AllHost
from dos_jax.policies import DeviceFraction
from dos_jax.policies import Plan
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One step's placement and update time.

  Attributes:
    step: the training step.
    plan: `Plan.describe()` of the plan the step ran.
    n_host: subgroups updated on the host.
    n_device: subgroups updated on the device (streamed or resident).
    n_resident: of those, the subgroups whose state stays in device memory.
    bytes_h2d: bytes the plan moves host -> device.
    bytes_d2h: bytes the plan moves device -> host.
    predicted_s: the cost model's update-phase time.
    measured_s: the measured update-phase time (None when not measured this step).
    migrated_subgroups: subgroups whose tier changed before this step because the
      policy re-planned (0 when it did not).
    migration_bytes: state bytes those moves copy (H2D, D2H and within host memory).
    migration_s: the cost model's time for those copies, paid once.
  """

  step: int
  plan: str
  n_host: int
  n_device: int
  bytes_h2d: float
  bytes_d2h: float
  predicted_s: float
  measured_s: float | None = None
  n_resident: int = 0
  migrated_subgroups: int = 0
  migration_bytes: float = 0.0
  migration_s: float = 0.0

  @classmethod
  def of(cls, step: int, plan: Plan, prediction: Prediction, measured_s: float | None = None,
         *, migration: costmodel.Migration | None = None) -> StepRecord:
    moved = {}
    if migration is not None:
      moved = dict(migrated_subgroups=migration.subgroups, migration_s=migration.seconds,
                   migration_bytes=migration.bytes_h2d + migration.bytes_d2h)
    return cls(
        step=step, plan=plan.describe(), n_host=len(plan.host),
        n_device=len(plan.streamed) + len(plan.resident), n_resident=len(plan.resident),
        bytes_h2d=prediction.bytes_h2d, bytes_d2h=prediction.bytes_d2h,
        predicted_s=prediction.update_seconds, measured_s=measured_s, **moved,
    )

  @property
  def error_pct(self) -> float | None:
    """(predicted - measured) / measured, in percent."""
    if self.measured_s is None or self.measured_s <= 0:
      return None
    return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s

  def as_metrics(self, prefix: str = 'offload/') -> dict:
    """Flat scalars for a JSON-lines metrics log (the plan as its description)."""
    out = {f'{prefix}{k}': v for k, v in dataclasses.asdict(self).items() if k != 'step'}
    out['step'] = self.step
    if self.error_pct is not None:
      out[f'{prefix}error_pct'] = self.error_pct
    return out


def _bytes(n: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if n >= scale:
      return f'{n / scale:.3g} {unit}'
  return f'{n:.0f} B'


def _seconds(s: float | None) -> str:
  if s is None:
    return '-'
  return f'{s * 1e3:.3g} ms' if s < 1 else f'{s:.3g} s'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  line = lambda cells: '  '.join(str(c).rjust(w) for c, w in zip(cells, widths)).rstrip()
  return '\n'.join([line(header), line(['-' * w for w in widths])] + [line(r) for r in rows])


def explain(what) -> str:
  """A readable table of one `StepRecord` or a sequence of them (predicted vs
  measured, error %), or `what.explain()` for anything that has one (an `Auto`)."""
  if hasattr(what, 'explain') and not isinstance(what, StepRecord):
    return what.explain()
  records = [what] if isinstance(what, StepRecord) else list(what)
  if not records:
    return '(no step records)'
  rows = []
  for r in records:
    err = r.error_pct
    rows.append([
        r.step, r.n_device, r.n_host, _bytes(r.bytes_h2d), _bytes(r.bytes_d2h),
        _seconds(r.predicted_s), _seconds(r.measured_s), '-' if err is None else f'{err:+.1f}%',
    ])
  header = ['step', 'device', 'host', 'H2D', 'D2H', 'predicted', 'measured', 'error']
  plans = sorted({r.plan for r in records})
  return '\n'.join(['plan: ' + p for p in plans] + [_table(header, rows)])


def baselines(spec: SubgroupSpec) -> dict[str, Plan]:
  """The fixed plans every choice is compared with."""
  return {
      'AllHost': AllHost().plan(spec),
      'Stride(2)': Stride(2).plan(spec),
      'DeviceFraction(0.5)': DeviceFraction(0.5).plan(spec),
  }


def explain_choice(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    ranking: Sequence,
    chosen: Plan,
    *,
    corrections: Sequence[str] = (),
    top: int = 5,
    backward_seconds: float = 0.0,
) -> str:
  """Why `chosen`: the number of candidates, the fastest few that fit, baselines, and
  the corrections applied to the profile so far."""
  fitting = [c for c in ranking if c.fits]
  lines = [
      f'profile {profile.name}; {spec.num_subgroups} subgroups of {spec.subgroup_size:,}'
      f' elements; {len(ranking)} candidate plans, {len(fitting)} fit the device budget',
      f'chosen: {chosen.describe()}',
  ]
  rows = []
  for i, c in enumerate(fitting[:top]):
    p = c.prediction
    rows.append([
        i + 1, c.plan.describe(), _seconds(p.update_seconds), _seconds(p.device_stream_seconds),
        _seconds(p.host_seconds), p.bound, _bytes(p.device_peak_bytes),
    ])
  for name, plan in baselines(spec).items():
    p = costmodel.predict(profile, spec, plan, backward_seconds=backward_seconds)
    rows.append([
        name, plan.describe(), _seconds(p.update_seconds), _seconds(p.device_stream_seconds),
        _seconds(p.host_seconds), p.bound, _bytes(p.device_peak_bytes),
    ])
  header = ['#', 'plan', 'update', 'stream', 'host', 'bound', 'device mem']
  lines.append(_table(header, rows))
  lines += [f'correction: {c}' for c in corrections]
  return '\n'.join(lines)
