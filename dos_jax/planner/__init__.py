"""The planner: where each subgroup's optimizer state should live, and why.

One path through it, in order:

* profile    -- `hardware.HardwareProfile` holds a machine's rates (PCIe each way,
                host and device AdamW throughput, free device memory); presets for the
                paper's nodes live there, `calibrate` measures this machine and caches
                the result.
* prediction -- `costmodel.predict` turns a profile, the packed state's shape
                (`SubgroupSpec`) and a `Plan` (resident / streamed / host subgroups)
                into a `Prediction` of the update phase, and `costmodel.migration` the
                one-off cost of a change of plan; `disk.predict` adds the disk tier
                (the host subgroups beyond a host-memory budget); `memory` sizes each tier, and
                `memory.check_run` checks a run against the memory this machine has
                before anything is allocated; `step_memory.predict_step` predicts
                what XLA's memory analysis of the compiled step reports.
* choice     -- `auto.Auto` predicts a bounded candidate set and keeps the fastest plan
                that fits, then re-plans when measurements depart from the prediction
                (`fitting` corrects the profile from them).
* report     -- `report.StepRecord` is what a run logs per step and `report.explain`
                prints; `plan_cli` is `dos-jax plan`, all of the above before a run.

The public names (`Auto`, `HardwareProfile`, `StepRecord`, `explain`) are re-exported
from `dos_jax`.
"""
