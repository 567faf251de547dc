"""The disk tier in the plan: which host subgroups a host-memory budget sends to disk,
and what their update costs.

A device's share of host memory (`host_memory_bytes`) holds the streamed tier's state,
the host-updated subgroups' gradients and new params, and what it can of the host tier's
state. The rule is the state's (`dos_jax.geometry.partition.spill_to_disk`): of a plan's
host subgroups, the last ones (their gradients arrive first, for the early host calls)
stay in memory as far as that leaves room; the first ones go to disk. A plan whose
streamed state and host staging alone exceed it does not fit (`host_fits`). Each
disk subgroup's update streams its fp32 state (`state_bytes_per_element`: master, m, v)
from its file and back, reading ahead and writing behind while the native kernel
updates it, so it costs the larger of its disk I/O and its host AdamW:

    disk seconds = max(R / read + W / write, elements / host AdamW),

with R = W the disk subgroups' state bytes, or (R + W) / mixed when the profile has
the disk's mixed bandwidth (one thread reading while another writes). That call runs
after the backward pass, after the in-memory host calls, with no speculation; it is
the last part of the host path (`costmodel.predict(..., disk_seconds=...)`). Keeping
subgroups resident on the device leaves fewer in host memory, so fewer on disk; `Auto`
weighs that through the same prediction (`Auto(host_memory_bytes=...)`).
"""

from __future__ import annotations

import dataclasses

from dos_jax.geometry import partition as partition_lib
from dos_jax.planner import costmodel
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class DiskSplit:
  """A plan's host subgroups split by a host-memory budget, and the disk part's cost.

  Attributes:
    in_memory: host subgroups whose state stays in host memory (ascending).
    host_state_bytes: the host tier's share of host memory: what `dos_jax.Disk`'s
      `host_state_bytes` is for this plan (None: no limit).
    fits: whether the streamed state and the host staging fit host memory at all.
    on_disk: host subgroups whose state lives in files (ascending).
    state_bytes: the disk subgroups' state, bytes read and again written per step.
    io_seconds: reading and writing that state at the profile's disk bandwidths.
    adamw_seconds: the disk subgroups' host AdamW.
  """

  in_memory: tuple[int, ...]
  on_disk: tuple[int, ...]
  host_state_bytes: float | None
  fits: bool
  state_bytes: float
  io_seconds: float
  adamw_seconds: float

  @property
  def seconds(self) -> float:
    """The disk subgroups' host call: I/O and update overlap, the slower one bounds it."""
    return max(self.io_seconds, self.adamw_seconds)

  @property
  def space_bytes(self) -> float:
    """Disk space the tier needs: two generations of each subgroup's file."""
    return 2 * self.state_bytes


def as_run(profile: HardwareProfile, plan: Plan) -> Plan:
  """`plan` as the program runs it: on a profile whose device is the host (the CPU
  program) every subgroup is updated on the host, whatever the plan."""
  if profile.device_is_host and not plan.all_resident:
    return Plan(streamed=(), host=tuple(range(plan.num_subgroups)))
  return plan


def host_tier_bytes(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan,
                    host_memory_bytes: float) -> float:
  """Host memory per device left for the host tier's state by `plan`: `host_memory_bytes`
  less the streamed tier's state and the host-updated subgroups' gradients in and new
  params out (negative: the plan does not fit)."""
  plan = as_run(profile, plan)
  per = spec.subgroup_size
  streamed = spec.state_bytes_per_element * per * len(plan.streamed)
  staging = 2 * spec.param_bytes_per_element * per * len(plan.host)
  return host_memory_bytes - streamed - staging


def host_fits(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan,
              host_memory_bytes: float | None) -> bool:
  return host_memory_bytes is None or host_tier_bytes(
      profile, spec, plan, host_memory_bytes) >= 0


def io_seconds(profile: HardwareProfile, read_bytes: float, write_bytes: float) -> float:
  """Reading `read_bytes` and writing `write_bytes` on the profile's disk: at the mixed
  bandwidth when measured, else the two one after the other."""
  if not read_bytes and not write_bytes:
    return 0.0
  if not profile.has_disk:
    raise ValueError(f'profile {profile.name!r} has no disk bandwidths: calibrate them on'
                     ' the directory (`calibrate.cached_disk`, `dos-jax plan --disk DIR`)'
                     ' or state them (`--disk-gbps READ,WRITE`)')
  if profile.disk_mixed_gbps is not None:
    return (read_bytes + write_bytes) / (profile.disk_mixed_gbps * _GB)
  return read_bytes / (profile.disk_read_gbps * _GB) + write_bytes / (
      profile.disk_write_gbps * _GB)


def spill(host: tuple[int, ...], in_memory: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """`(in memory, on disk)`: the ascending `host` subgroups with the last `in_memory`
  kept in memory, the state's rule (`dos_jax.geometry.partition.spill_to_disk`)."""
  return partition_lib.spill_to_disk(host, partition_lib.DiskSpill('', max(0, in_memory)))


def split(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan,
          host_memory_bytes: float | None) -> DiskSplit:
  """`plan`'s host subgroups split by `host_memory_bytes` per device (None: no limit;
  see the module docstring)."""
  host = tuple(sorted(as_run(profile, plan).host))
  cap = None if host_memory_bytes is None else max(
      host_tier_bytes(profile, spec, plan, host_memory_bytes), 0.0)
  if cap is None:
    in_memory, on_disk = host, ()
  else:
    keep = int(cap // (spec.state_bytes_per_element * spec.subgroup_size))
    in_memory, on_disk = spill(host, keep)
  elements = sum(costmodel.subgroup_sizes(spec)[g] for g in on_disk)
  state = float(spec.state_bytes_per_element * elements)
  return DiskSplit(in_memory=in_memory, on_disk=on_disk, host_state_bytes=cap,
                   fits=host_fits(profile, spec, plan, host_memory_bytes),
                   state_bytes=state,
                   io_seconds=io_seconds(profile, state, state),
                   adamw_seconds=elements / (profile.host_adamw_gparams() * _GB))


def predict(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, *,
            host_memory_bytes: float | None = None, backward_seconds: float = 0.0,
            last_grad_bytes: float = 0.0) -> costmodel.Prediction:
  """`costmodel.predict` of `plan` with the host subgroups beyond `host_memory_bytes`
  (per device; None: no limit) on disk, their host call last on the host path."""
  tier = split(profile, spec, plan, host_memory_bytes)
  return costmodel.predict(profile, spec, plan, backward_seconds=backward_seconds,
                           last_grad_bytes=last_grad_bytes, disk_subgroups=tier.on_disk,
                           disk_seconds=tier.seconds)
