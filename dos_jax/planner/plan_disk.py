"""The disk tier in `dos-jax plan`: its options, the host memory left for the state, and
the lines that show the tier.

`--disk DIR` takes the disk bandwidths of DIR (the profile's when it was measured there,
else calibrated now and cached: `calibrate.cached_disk`); `--disk-gbps READ,WRITE` states
them. Either turns the disk tier on: each device's share of the node's host memory
(`--host-memory-gib`, else `--host-memory`, else this machine's) less the margin holds
the streamed state, the host-bound gradients and new params, and what it can of the host
subgroups' state; the rest goes to disk (`planner.disk`), whose bandwidth the node's
devices share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil

from dos_jax.planner import disk
from dos_jax.planner import memory
from dos_jax.planner import plan_args
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.planner.plan_args import gib
from dos_jax.planner.plan_args import ms
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec


def _free_bytes(directory: str) -> float:
  try:
    return float(shutil.disk_usage(directory).free)
  except OSError:
    return 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument('--disk', metavar='DIR', help='a disk tier in DIR: the host subgroups\''
                 ' state beyond host memory goes there; its read, write and mixed bandwidth'
                 ' are measured on DIR (256 MiB; cached) unless the profile has them')
  p.add_argument('--disk-gbps', type=plan_args.gbps_pair, metavar='READ,WRITE',
                 help='a disk tier with these read and write bandwidths, GB/s, not measured')
  p.add_argument('--host-memory-gib', type=plan_args.positive_float, metavar='N',
                 help='host memory per node for the state, GiB (default: --host-memory, else,'
                 ' with a disk tier, this machine\'s; otherwise the profile\'s)')


def enabled(args) -> bool:
  return bool(args.disk or args.disk_gbps)


def disk_profile(args, profile: HardwareProfile) -> HardwareProfile:
  """`profile` with the disk bandwidths the flags give; ValueError naming the flag."""
  if args.disk and args.disk_gbps:
    raise ValueError('--disk-gbps: give either --disk DIR (measured) or --disk-gbps')
  if args.disk_gbps:
    read, write = args.disk_gbps
    return dataclasses.replace(profile, disk_read_gbps=read, disk_write_gbps=write,
                               disk_mixed_gbps=None, disk_dir=None)
  if args.disk:
    from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
    try:
      return calibrate.cached_disk(profile, args.disk)
    except ValueError as e:
      raise ValueError(f'--disk: {e}') from None
  return profile


def host_memory(args, profile: HardwareProfile) -> float:
  """The node's host memory for the state (0: unknown)."""
  if args.host_memory_gib:
    return args.host_memory_gib * 2**30
  if args.host_memory:
    return args.host_memory
  if enabled(args):
    try:
      return float(os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
    except (ValueError, OSError):
      return 0.0
  return profile.host_memory_bytes


def per_device_memory(host_bytes: float, devices: int) -> float:
  """A device's share of the node's host memory for the optimizer, less the margin."""
  return host_bytes * (1 - memory.MARGIN) / devices


def shared(profile: HardwareProfile, devices: int) -> HardwareProfile:
  """`profile` with its disk bandwidths divided among the node's `devices`: each device's
  process streams its own disk subgroups through the node's one disk (the profile's
  other rates are a device's share already)."""
  if not profile.has_disk or devices == 1:
    return profile
  mixed = profile.disk_mixed_gbps
  return dataclasses.replace(
      profile, disk_read_gbps=profile.disk_read_gbps / devices,
      disk_write_gbps=profile.disk_write_gbps / devices,
      disk_mixed_gbps=None if mixed is None else mixed / devices)


def profile_note(profile: HardwareProfile) -> str:
  """The profile's disk, for the line that names the profile."""
  if not profile.has_disk:
    return ''
  mixed = (f', {profile.disk_mixed_gbps:.3g} mixed' if profile.disk_mixed_gbps is not None
           else '')
  where = f'measured on {profile.disk_dir}' if profile.disk_dir else 'stated'
  return (f', disk {profile.disk_read_gbps:.3g} read / {profile.disk_write_gbps:.3g} write'
          f'{mixed} GB/s per node ({where})')


def lines(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, host_bytes: float,
          devices: int, directory: str | None) -> list[str]:
  """The chosen plan's four tiers, the host memory and disk space it needs, and its
  disk call's time (`profile`: a device's share of the disk, `shared`)."""
  tier = disk.split(profile, spec, plan, per_device_memory(host_bytes, devices))
  plan = disk.as_run(profile, plan)
  per = spec.state_bytes_per_element * spec.subgroup_size * devices
  node = f' x {devices} devices' if devices > 1 else ''
  out = [f'\nfour tiers (chosen plan; subgroups per device, state per node{node}):']
  for name, ids in (('resident', plan.resident), ('streamed', plan.streamed),
                    ('host', tier.in_memory), ('disk', tier.on_disk)):
    out.append(f'  {name:9} {len(ids):5} subgroups  {gib(per * len(ids)):>12}')
  state = per * (len(plan.streamed) + len(tier.in_memory))
  staging = 2 * spec.param_bytes_per_element * spec.subgroup_size * len(plan.host) * devices
  out.append(f'  host memory the plan needs (node): state {gib(state)} + host-bound gradients'
             f' and new params {gib(staging)} = {gib(state + staging)} of {gib(host_bytes)}'
             f' ({memory.MARGIN:.0%} kept free)')
  if tier.host_state_bytes is not None and tier.on_disk:
    out.append(f'  host tier\'s state in memory: {gib(tier.host_state_bytes)} per device'
               f' (dos_jax.Disk(host_state_bytes=...), offload.host_state_gib)')
  space = tier.space_bytes * devices
  free = ''
  if directory:
    free = f'; {gib(_free_bytes(directory))} free at {directory} on this machine'
  out.append(f'  disk space it needs (node): {gib(space)} (two generations of'
             f' {gib(space / 2)} of state){free}')
  if tier.on_disk:
    gb = tier.state_bytes / 1e9
    rates = (f'{gb:.3g} GB read + {gb:.3g} GB written at {profile.disk_mixed_gbps:.3g} GB/s'
             ' mixed' if profile.disk_mixed_gbps is not None else
             f'{gb:.3g} GB / {profile.disk_read_gbps:.3g} GB/s read + {gb:.3g} GB /'
             f' {profile.disk_write_gbps:.3g} GB/s write')
    out.append(f'  disk call per device, after its in-memory host calls, the disk\'s'
               f' bandwidth shared by {devices}: max(I/O {ms(tier.io_seconds)} ({rates}),'
               f' host AdamW {ms(tier.adamw_seconds)}) = {ms(tier.seconds)}')
  return out


def disk_short(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, host_bytes: float,
               devices: int, directory: str | None) -> list[str]:
  """What the disk tier's plan lacks: host memory for the streamed state and the host
  staging, and, given the `directory` of this machine's disk (`--profile this`), disk
  space."""
  tier = disk.split(profile, spec, plan, per_device_memory(host_bytes, devices))
  out = []
  if not tier.fits:
    lack = -disk.host_tier_bytes(profile, spec, plan, per_device_memory(host_bytes, devices))
    out.append(f'host memory short by {gib(lack * devices)} per node: the streamed state'
               ' and the host-bound gradients and new params cannot go to disk')
  if directory:
    space = tier.space_bytes * devices
    free = _free_bytes(directory) * (1 - memory.MARGIN)
    if space > free:
      out.append(f'disk at {directory} short by {gib(space - free)} (needs {gib(space)}:'
                 ' two generations of the state on disk)')
  return out
