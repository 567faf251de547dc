"""Per-step placement for adaptive policies (the cost model's `dos_jax.Auto`).

A fixed policy (`AllHost`, `Stride(k)`, ...) needs nothing from the loop: the optimizer
applies its plan. An adaptive policy also has `observe(plan, measured_update_seconds)
-> Plan`: the loop passes its plan to the step as a static argument (each plan
compiles once), reports measured update-phase times back, and logs the cost model's
per-step record (`dos_jax.StepRecord`: predicted next to measured update time).

The runner's step is one program, with no update phase of its own to time; the update
is timed only on the steps the loop runs split (see `dos_jax.train.step`). An adaptive
policy says when it needs a time through an optional `wants_measurement() -> bool`
(Auto: while its plan is unconfirmed); one without it is measured every step.
"""

from __future__ import annotations

from typing import Any

from dos_jax import AdaptivePolicy
from dos_jax import Plan
from dos_jax.planner import report


class PlanDriver:
  """Chooses each step's plan; `plan` is None for fixed policies."""

  def __init__(self, policy: Any, opt_state: Any):
    self._policy = policy if isinstance(policy, AdaptivePolicy) else None
    self.plan: Plan | None = None
    if self._policy is not None:
      self.plan = self._policy.plan(opt_state.layout.spec())

  def wants_measurement(self) -> bool:
    """Whether the policy needs the next step's update time (never for fixed ones)."""
    if self._policy is None:
      return False
    ask = getattr(self._policy, 'wants_measurement', None)
    return True if ask is None else bool(ask())

  def observe(self, step: int, update_seconds: float | None) -> dict[str, Any]:
    """Reports a step's update time (None: not measured, the step ran fused); returns
    metrics about its placement (may be empty). Only measured steps reach the policy."""
    if self._policy is None:
      return {}
    metrics: dict[str, Any] = {'offload/plan': self.plan.describe()}
    # Auto exposes the cost model's prediction of its current plan; other adaptive
    # policies may not predict at all.
    prediction = getattr(self._policy, 'prediction', None)
    if prediction is not None:
      metrics = report.StepRecord.of(step, self.plan, prediction, update_seconds).as_metrics()
    if update_seconds is not None:
      self.plan = self._policy.observe(self.plan, update_seconds)
    return metrics
