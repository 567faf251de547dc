"""The comparison of `dos-jax plan`: `Auto`'s plan beside the fixed baselines (update and
iteration times, device and host memory, what bounds each), the step as the program
runs it, the step across nodes, and why `Auto` is slower than a listed plan.

`job` is `plan_cli`'s: the run, the machine (`profile`, per device) and the state
(`spec`), with the forward and backward times (`fwd`, `bwd`; 0 without `tflops`).
"""

from __future__ import annotations

import dataclasses

from dos_jax.planner import costmodel
from dos_jax.planner import disk
from dos_jax.planner import plan_steps
from dos_jax.planner.plan_args import gib as _gib
from dos_jax.planner.plan_args import ms as _ms
from dos_jax.policies import AllDevice
from dos_jax.policies import AllHost
from dos_jax.policies import DeviceFraction
from dos_jax.policies import Plan
from dos_jax.policies import Resident
from dos_jax.policies import Stride


@dataclasses.dataclass(frozen=True)
class _Row:
  """One plan of the comparison table."""

  name: str
  plan: Plan
  iteration: costmodel.IterationPrediction
  fits: bool


def host_bytes(job, plan: Plan) -> float:
  """The optimizer state `plan` keeps in a node's pinned host memory: the streamed rows
  and the host tier's rows in memory (not those on disk)."""
  kept = disk.split(job.profile, job.spec, plan, job.host_cap).in_memory
  return (job.state_bytes * job.spec.subgroup_size * (len(plan.streamed) + len(kept))
          * job.devices)


def pool_bytes(job) -> float:
  """The pinned host pool of a node. Every subgroup on the host pins the most: the
  state, gradients in, new params out, and the undo of early host calls speculating on
  the clip factor (at most the state once more; the two-memory program without clipping
  has none)."""
  return job.size.num_elements * job.devices * (2 * job.state_bytes + 2 * job.param_bytes)


def _best_resident_only(profile, spec, budget, acts, bwd, last, host_state) -> Plan:
  """The fastest `Resident(r)` (the rest on the host, nothing streamed) that fits."""
  best = None
  for r in range(spec.num_subgroups + 1):
    plan = Resident(r).plan(spec)
    pred = disk.predict(profile, spec, plan, backward_seconds=bwd, last_grad_bytes=last,
                        host_memory_bytes=host_state)
    if pred.device_bytes_beside(acts) > budget:
      break
    if best is None or pred.update_seconds < best[1]:
      best = (plan, pred.update_seconds)
  return best[0] if best else AllHost().plan(spec)


def report(job, plan: Plan, *, budget: float, last: float, clip_rate: float,
           disk_seconds: float) -> None:
  """Prints the table of `plan` (Auto's, whose host call on disk takes `disk_seconds`)
  and the baselines, and the lines that follow it. `budget`: device memory for the
  update beside params and grads; `last`: `costmodel.predict`'s `last_grad_bytes`."""
  profile, spec, acts = job.profile, job.spec, job.size.activations
  fwd, bwd, tflops = job.fwd, job.bwd, job.tflops
  statics = [('AllHost', AllHost().plan(spec)), ('Stride(2)', Stride(2).plan(spec)),
             ('DeviceFraction(0.5)', DeviceFraction(0.5).plan(spec))]
  best_resident = _best_resident_only(profile, spec, budget, acts, bwd, last, job.host_cap)
  statics.append((f'Resident({len(best_resident.resident)}) (best resident-only)', best_resident))
  statics.append(('AllDevice', AllDevice().plan(spec)))
  rows = []
  for name, p in [('Auto (chosen)', plan)] + statics:
    it = costmodel.IterationPrediction(fwd, bwd, disk.predict(
        profile, spec, p, backward_seconds=bwd, last_grad_bytes=last,
        host_memory_bytes=job.host_cap))
    fits = (it.update.device_bytes_beside(acts) <= budget
            and disk.host_fits(profile, spec, p, job.host_cap))
    rows.append(_Row(name, p, it, fits))
  print(f'\n  {"plan":40} {"update":>9} {"iteration":>10}  {"resident":>9} {"buffers":>9}'
        f' {"host/node":>10}  bound')
  for row in rows:
    u = row.iteration.update
    iteration = _ms(row.iteration.iteration_seconds) if tflops else '-'
    name = row.name if row.fits else row.name + ' (no fit)'
    print(f'  {name:40} {_ms(u.update_seconds):>9} {iteration:>10}  {_gib(u.resident_bytes):>9}'
          f' {_gib(u.buffer_bytes):>9} {_gib(host_bytes(job, row.plan)):>10}  {u.bound}')
  if tflops:
    print(f'\n(forward {_ms(fwd)} + backward {_ms(bwd)} estimated at {tflops:g} TFLOP/s per device)')
    shown = [(n, p) for n, p in [('Auto (chosen)', plan)] + statics if p.host and p.streamed]
    shown += [(n, p) for n, p in statics if p.host and not p.streamed][:1]  # AllHost
    if disk_seconds:  # the timeline has no disk call
      shown = []
    for name, shown_plan in shown[:1] + shown[-1:] if len(shown) > 1 else shown:
      print(plan_steps.chunk_line(profile, spec, name, shown_plan, fwd, bwd, clip_rate))
  if job.nodes > 1:
    host_state = job.size.state_per_device * job.devices
    for line in plan_steps.across_nodes(profile, job.run.shape, job.nodes, job.devices,
                                        job.param_bytes,
                                        rows[0].iteration if tflops else None,
                                        host_state, pool_bytes(job)):
      print(line)
  for line in _why(rows, budget, acts):
    print(line)


def _why(rows: list[_Row], budget: float, acts: float) -> list[str]:
  """Why Auto's plan is slower than a listed one: that one does not fit (or, were a
  fitting plan faster, that it is not among Auto's candidates)."""
  chosen = rows[0].iteration.update.update_seconds
  out = []
  for row in rows[1:]:
    u = row.iteration.update
    if u.update_seconds >= chosen:
      continue
    if not row.fits:
      out.append(f'{row.name} would take {_ms(u.update_seconds)} but needs'
                 f' {_gib(u.device_bytes_beside(acts))} of device memory beside params and'
                 f' grads (resident state {_gib(u.resident_bytes)} + the larger of activations'
                 f' {_gib(acts)} and buffers {_gib(u.buffer_bytes)}); {_gib(budget)} is free')
    else:
      out.append(f'{row.name} ({_ms(u.update_seconds)}) fits but is not among Auto\'s'
                 ' candidates')
  return ['\nwhy Auto is slower than:'] + ['  ' + line for line in out] if out else []
