"""Per-step placement for adaptive policies (the cost model's `dos_jax.Auto`).

A fixed policy (`AllHost`, `Stride(k)`, ...) needs nothing from the loop: the optimizer
applies its plan. An adaptive policy also has `observe(plan, measured_update_seconds)
-> Plan`: the loop passes its plan to the update step as a static argument (each plan
compiles once), reports the measured update-phase time back, and logs the cost model's
per-step record (`dos_jax.StepRecord`: predicted next to measured update time).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from dos_jax import report
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec


@runtime_checkable
class AdaptivePolicy(Protocol):
  """A placement policy that re-plans from measured update times."""

  def plan(self, spec: SubgroupSpec) -> Plan:
    ...

  def observe(self, plan: Plan, measured_update_seconds: float) -> Plan:
    ...


class PlanDriver:
  """Chooses each step's plan; `plan` is None for fixed policies."""

  def __init__(self, policy: Any, opt_state: Any):
    self._policy = policy if isinstance(policy, AdaptivePolicy) else None
    self.plan: Plan | None = None
    if self._policy is not None:
      self.plan = self._policy.plan(opt_state.layout.spec())

  def observe(self, step: int, update_seconds: float) -> dict[str, Any]:
    """Reports a step's update time; returns metrics about its placement (may be empty)."""
    if self._policy is None:
      return {}
    metrics: dict[str, Any] = {'offload/plan': self.plan.describe()}
    # Auto exposes the cost model's prediction of its current plan; other adaptive
    # policies may not predict at all.
    prediction = getattr(self._policy, 'prediction', None)
    if prediction is not None:
      metrics = report.StepRecord.of(step, self.plan, prediction, update_seconds).as_metrics()
    self.plan = self._policy.observe(self.plan, update_seconds)
    return metrics
