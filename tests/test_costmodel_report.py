"""Step records and their explanation."""

import json
import math

from dos_jax.planner import costmodel
from dos_jax.planner import report
from dos_jax.planner.auto import Auto
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec


def test_step_record_metrics_and_table():
  p = costmodel.H100_PCIE_GEN5_NODE
  spec = SubgroupSpec(10, 10**8, 10 * 10**8 - 5, 12, 2, 2)
  plan = Stride(2).plan(spec)
  pred = costmodel.predict(p, spec, plan)
  rec = report.StepRecord.of(7, plan, pred, measured_s=pred.update_seconds * 1.25)
  assert (rec.n_device, rec.n_host) == (5, 5)
  assert math.isclose(rec.error_pct, 100 * (1 / 1.25 - 1))
  metrics = rec.as_metrics()
  json.dumps(metrics)  # scalars and strings only
  assert metrics['step'] == 7 and metrics['offload/n_device'] == 5
  assert metrics['offload/bytes_h2d'] == 5 * 10**8 * 12 + 5 * 10**8 * 2  # whole rows
  text = report.explain([rec, report.StepRecord.of(8, plan, pred)])
  lines = text.splitlines()
  assert lines[0] == 'plan: ' + plan.describe()
  assert '-20.0%' in text and len(lines) == 5


def test_explain_auto_lists_candidates_and_baselines():
  spec = SubgroupSpec(17, 10**8, 17 * 10**8, 12, 2, 2)
  policy = Auto(costmodel.H100_PCIE_GEN5_NODE, budget_bytes=10e9)
  plan = policy.plan(spec)
  text = report.explain(policy)
  assert f'chosen: {plan.describe()}' in text
  for name in ('AllHost', 'Stride(2)', 'DeviceFraction(0.5)', 'candidate plans'):
    assert name in text


def test_auto_records_its_current_plan():
  spec = SubgroupSpec(17, 10**8, 17 * 10**8, 12, 2, 2)
  policy = Auto(costmodel.H100_PCIE_GEN5_NODE, budget_bytes=10e9)
  plan = policy.plan(spec)
  rec = policy.record(3, 0.5)
  assert rec.step == 3 and rec.measured_s == 0.5
  assert rec.n_device == len(plan.streamed) + len(plan.resident)
  assert rec.n_resident == len(plan.resident)
  assert rec.migrated_subgroups == 0 and rec.migration_s == 0.0
  assert rec.predicted_s == costmodel.predict(policy.profile, spec, plan).update_seconds
