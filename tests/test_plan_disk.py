"""The disk tier in the planner: the profile's disk bandwidths (calibrated or stated), the
cost model's disk call, `Auto` over four tiers, and `dos-jax plan --disk/--disk-gbps`."""

import dataclasses
import json
import math
import os
import pathlib
import re

import numpy as np
import pytest

from dos_jax import lowering as lowering_lib
from dos_jax import cli
from dos_jax.planner import auto
from dos_jax.planner import calibrate
from dos_jax.planner import costmodel
from dos_jax.planner import disk
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.policies import AllHost
from dos_jax.policies import Resident
from dos_jax.policies import SubgroupSpec

# The plan's device memory follows the construction this jax builds: with regions that
# hold a lane's rows (jax 0.10-0.11, the GPU machines') every streamed row is held until
# the lanes are done; staged (jax 0.12) one row per lane; the 70B figures are the former's.
_REGIONS = pytest.mark.skipif(
    not lowering_lib.regions_hold_every_row(),
    reason="the staged lowering (jax 0.12) holds one streamed row per lane: the device "
           "holds fewer streamed rows (the doc's figures are jax 0.10-0.11's)")

GIB = 2**30
NODE_70B = ['--model', '70b', '--gpus-per-node', '8', '--disk-gbps', '6,4',
            '--host-memory-gib', '512', '--seq-len', '1024']


def run(capsys, *argv):
  code = cli.main(['plan', *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def _tiers(out: str) -> dict[str, int]:
  return {name: int(count) for name, count in
          re.findall(r'^  (resident|streamed|host|disk) +(\d+) subgroups', out, re.M)}


def _spec(n: int = 12, size: int = 10**7) -> SubgroupSpec:
  return SubgroupSpec(num_subgroups=n, subgroup_size=size, num_elements=n * size,
                      state_bytes_per_element=12, param_bytes_per_element=2,
                      grad_bytes_per_element=2, decayed_rows=n - 1)


@_REGIONS
def test_70b_on_a_512_gib_node_fits_with_four_tiers(capsys):
  """Issue 42's plan: 70B's 840 GB of state beside 512 GiB of host memory on a node of
  8 H100s; what neither the devices nor host memory hold goes to disk."""
  code, out, _ = run(capsys, *NODE_70B)
  assert code == 0, out
  tiers = _tiers(out)
  assert sum(tiers.values()) == 88 and tiers['disk'] > 0
  assert all(tiers[t] > 0 for t in ('resident', 'streamed', 'host')), tiers
  needs, of = (float(x.replace(',', '')) for x in re.search(
      r'host memory the plan needs \(node\): .* = ([\d,.]+) GiB of ([\d,.]+) GiB',
      out).groups())
  assert of == 512 and needs <= 0.95 * 512
  space, state = (float(x.replace(',', '')) for x in re.search(
      r'disk space it needs \(node\): ([\d,.]+) GiB \(two generations of ([\d,.]+) GiB',
      out).groups())
  assert space == pytest.approx(2 * state, abs=0.1)
  assert state == pytest.approx(tiers['disk'] * 1e8 * 12 * 8 / GIB, abs=0.1)
  assert re.search(r'^  Auto \(chosen\) +[\d,.]+ s .* host \+ disk$', out, re.M), out
  # The command, 2048-token sequences: without remat the activations leave no
  # room, so the plan recomputes each block, says so, and fits; --no-remat refuses.
  code, out, _ = run(capsys, *NODE_70B[:-2])
  assert code == 0 and 'planned with --remat' in out and ', remat;' in out, out
  assert sum(_tiers(out).values()) == 88, out
  code, out, _ = run(capsys, *NODE_70B[:-2], '--no-remat')
  assert code == 1 and 'device memory: no plan fits beside the activations' in out
  assert 'planned with --remat' not in out


def test_disk_time_is_bytes_over_bandwidth(seed):
  rng = np.random.default_rng(seed)
  spec = _spec()
  read, write = rng.uniform(0.5, 8.0, size=2)
  profile = dataclasses.replace(costmodel.H100_PCIE_GEN5_NODE, disk_read_gbps=read,
                                disk_write_gbps=write)
  plan = AllHost().plan(spec)
  keep = int(rng.integers(1, spec.num_subgroups - 1))
  per = 12 * spec.subgroup_size
  staging = 2 * 2 * spec.subgroup_size * spec.num_subgroups  # gradients in, params out
  host_memory = staging + keep * per + per / 2
  pred = disk.predict(profile, spec, plan, host_memory_bytes=host_memory)
  on_disk = spec.num_subgroups - keep
  state = on_disk * per
  io = state / (read * 1e9) + state / (write * 1e9)
  adamw = on_disk * spec.subgroup_size / (profile.host_adamw_gparams() * 1e9)
  assert pred.disk_seconds == pytest.approx(max(io, adamw), rel=1e-12)
  tier = disk.split(profile, spec, plan, host_memory)
  # The first subgroups go to disk, the last stay in memory (their gradients come first).
  assert tier.on_disk == tuple(range(on_disk)) and tier.in_memory == tuple(
      range(on_disk, spec.num_subgroups))
  # The disk call follows the in-memory host work on the host path, which does less.
  no_disk = costmodel.predict(profile, spec, plan)
  assert pred.disk_seconds < pred.host_seconds <= no_disk.host_seconds + pred.disk_seconds
  assert pred.update_seconds >= pred.host_seconds and pred.bound == 'host + disk'
  # Measured mixed bandwidth: both directions' bytes at that one rate.
  mixed = float(rng.uniform(0.5, 8.0))
  pred = disk.predict(dataclasses.replace(profile, disk_mixed_gbps=mixed), spec, plan,
                      host_memory_bytes=host_memory)
  assert pred.disk_seconds == pytest.approx(max(2 * state / (mixed * 1e9), adamw), rel=1e-12)
  # A disk faster than the host update: the update bounds the disk call.
  fast = dataclasses.replace(profile, disk_read_gbps=1e4, disk_write_gbps=1e4)
  assert disk.predict(fast, spec, plan, host_memory_bytes=host_memory).disk_seconds == (
      pytest.approx(adamw, rel=1e-12))


def test_a_budget_that_holds_everything_gives_no_disk_tier(capsys):
  spec = _spec()
  profile = dataclasses.replace(costmodel.H100_PCIE_GEN5_NODE, disk_read_gbps=1.0,
                                disk_write_gbps=1.0)
  plan = AllHost().plan(spec)
  tier = disk.split(profile, spec, plan, 1e12)
  assert tier.on_disk == () and tier.state_bytes == 0 and tier.seconds == 0
  assert disk.predict(profile, spec, plan, host_memory_bytes=1e12) == costmodel.predict(
      profile, spec, plan)
  code, out, _ = run(capsys, '--model', '70b', '--gpus-per-node', '8', '--disk-gbps', '6,4',
                     '--host-memory-gib', '4096', '--seq-len', '1024')
  assert code == 0 and _tiers(out)['disk'] == 0, out
  assert 'disk call' not in out


def test_keeping_subgroups_resident_leaves_fewer_on_disk():
  spec = _spec()
  profile = dataclasses.replace(costmodel.H100_PCIE_GEN5_NODE, disk_read_gbps=2.0,
                                disk_write_gbps=2.0)
  host_memory = 6 * 12 * spec.subgroup_size
  counts = [len(disk.split(profile, spec, Resident(r).plan(spec), host_memory).on_disk)
            for r in range(spec.num_subgroups + 1)]
  assert counts[0] > 0 and counts[-1] == 0
  assert all(a >= b for a, b in zip(counts, counts[1:]))
  # Auto weighs it: with room for 8 resident subgroups, the disk tier shrinks to what
  # the device cannot take, and the plan fits.
  budget = 8 * 12 * spec.subgroup_size
  policy = auto.Auto(profile, budget_bytes=budget, host_memory_bytes=host_memory)
  plan = policy.plan(spec)
  assert policy.ranking[0].fits and len(plan.resident) >= 1
  assert len(disk.split(profile, spec, plan, host_memory).on_disk) < counts[0]


def test_a_plan_without_disk_bandwidths_is_refused():
  spec = _spec()
  with pytest.raises(ValueError, match='no disk bandwidths'):
    disk.predict(costmodel.H100_PCIE_GEN5_NODE, spec, AllHost().plan(spec),
                 host_memory_bytes=0.0)
  with pytest.raises(ValueError, match='come together'):
    dataclasses.replace(costmodel.H100_PCIE_GEN5_NODE, disk_read_gbps=1.0)


def test_calibrate_disk_measures_and_cleans_up(tmp_path, monkeypatch):
  rates = calibrate.calibrate_disk(tmp_path, 16 << 20)
  for value in (rates.read_gbps, rates.write_gbps, rates.mixed_gbps):
    assert math.isfinite(value) and value > 0
  assert rates.directory == str(tmp_path) and os.listdir(tmp_path) == []
  profile = calibrate.with_disk(costmodel.H100_PCIE_GEN5_NODE, rates)
  assert profile.has_disk and profile.disk_dir == str(tmp_path)
  assert HardwareProfile.from_dict(json.loads(profile.to_json())) == profile
  # Cached per host and directory: a second call measures nothing.
  monkeypatch.setenv(calibrate.CACHE_DIR_ENV, str(tmp_path / 'cache'))
  first = calibrate.cached_disk(costmodel.H100_PCIE_GEN5_NODE, tmp_path, size_bytes=1 << 20)
  monkeypatch.setattr(calibrate, 'calibrate_disk', lambda *a, **k: pytest.fail('measured'))
  assert calibrate.cached_disk(costmodel.H100_PCIE_GEN5_NODE, tmp_path) == first
  assert calibrate.cached_disk(first, tmp_path) is first  # the profile's own
  monkeypatch.undo()
  with pytest.raises(ValueError, match='not a directory'):
    calibrate.calibrate_disk(tmp_path / 'absent')


@pytest.mark.parametrize('value', ['6', '6,x', '6,-4', '0,4', '6,4,2', 'inf,4'])
def test_bad_disk_gbps_is_one_line(capsys, value):
  with pytest.raises(SystemExit) as e:
    cli.main(['plan', '--model', '7b', '--disk-gbps', value])
  assert e.value.code == 2
  last = capsys.readouterr().err.splitlines()[-1]
  assert '--disk-gbps' in last and 'READ,WRITE' in last


@pytest.mark.parametrize('argv, culprit', [
    (['--disk', '/nonexistent/dos_jax'], '--disk: not a directory'),
    (['--disk', '.', '--disk-gbps', '6,4'], '--disk-gbps: give either'),
])
def test_bad_disk_options_exit_2_in_one_line(capsys, argv, culprit):
  code, _, err = run(capsys, '--model', '7b', *argv)
  assert code == 2 and err.count('\n') == 1 and culprit in err


@_REGIONS
def test_the_planner_doc_shows_this_output(capsys):
  """docs/planner.md's disk-tier section quotes the 70B plan; its lines are the tool's."""
  doc = (pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'planner.md').read_text()
  block = doc.split('## The disk tier in the plan')[1].split('\n## ')[0]
  code, out, _ = run(capsys, *NODE_70B)
  assert code == 0
  lines = out.splitlines()
  start = lines.index(next(l for l in lines if l.startswith('four tiers')))
  quoted = [lines[2]] + lines[start:start + 9] + [
      l for l in lines if re.match(r'  (plan  |Auto \(chosen\)|AllHost )', l)]
  for line in quoted:
    assert line in block.splitlines(), line
  # The paragraph's other figures: 2048 tokens without remat do not fit; with remat (taken
  # unasked) no disk.
  code, out, _ = run(capsys, *NODE_70B[:-2])
  assert code == 0 and _tiers(out) == {'resident': 34, 'streamed': 54, 'host': 0, 'disk': 0}
  folded = ' '.join(block.split())
  assert '= 482.8 GiB of 512.0 GiB' in out
  assert ('plans with `--remat` and says so in its first line' in folded
          and 'then 34 resident and 54 streamed subgroups hold everything in 482.8 GiB'
          in folded), folded
