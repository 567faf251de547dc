"""The planner with three tiers: resident-first choices on synthetic profiles, the
memory model, the preset sizes, and the memory check before `dos-jax train` allocates."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax import model_shapes
from dos_jax.planner import auto
from dos_jax.planner import costmodel
from dos_jax.planner import memory
from dos_jax.planner.costmodel import HardwareProfile
from dos_jax.policies import SubgroupSpec


def profile(u_host, u_dev, bw, slowdown=1.0):
  return HardwareProfile(
      name='synthetic', h2d_gbps=bw, d2h_gbps=bw, both_gbps=bw * 0.8,
      host_adamw_gparams_by_threads={8: u_host}, device_adamw_gparams=u_dev,
      device_free_bytes=80e9, host_copy_slowdown=slowdown)


SPEC = SubgroupSpec(num_subgroups=24, subgroup_size=10**8, num_elements=24 * 10**8 - 7,
                    state_bytes_per_element=12, param_bytes_per_element=2,
                    grad_bytes_per_element=2)
ROW = 12 * 10**8  # state bytes of one subgroup


@pytest.mark.parametrize('seed', range(6))
def test_resident_first_when_memory_allows(seed):
  """On random synthetic machines (device AdamW faster than the host's, PCIe far slower
  than device memory), Auto keeps as many subgroups resident as fit beside the
  activations, and is never slower than any plan that fits, resident-only and static
  ones included. (With activations smaller than 3 subgroups, Auto may give up a
  resident row or two for streamed buffers; the activations here are larger.)"""
  rng = np.random.default_rng(seed)
  p = profile(u_host=rng.uniform(0.3, 3), u_dev=rng.uniform(20, 80), bw=rng.uniform(5, 60),
              slowdown=rng.uniform(1, 1.5))
  acts = rng.uniform(3, 6) * ROW
  fit_rows = int(rng.integers(1, SPEC.num_subgroups + 4))
  budget = acts + fit_rows * ROW + 0.5 * ROW
  best, pred = auto.choose(p, SPEC, budget, activation_bytes=acts)
  assert len(best.resident) == min(fit_rows, SPEC.num_subgroups), best.describe()
  assert pred.device_bytes_beside(acts) <= budget
  others = [dos_jax.AllHost(), dos_jax.Stride(2), dos_jax.DeviceFraction(0.5),
            dos_jax.AllDevice()] + [dos_jax.Resident(r) for r in range(SPEC.num_subgroups + 1)]
  for policy in others:
    other = costmodel.predict(p, SPEC, policy.plan(SPEC))
    if other.device_bytes_beside(acts) <= budget:
      assert pred.update_seconds <= other.update_seconds * (1 + 1e-9), policy


def test_when_the_state_fits_auto_is_at_least_as_fast_as_all_device():
  p = profile(u_host=1.0, u_dev=50.0, bw=25.0)
  all_device = costmodel.predict(p, SPEC, dos_jax.AllDevice().plan(SPEC))
  _, pred = auto.choose(p, SPEC, all_device.resident_bytes + ROW, activation_bytes=ROW)
  assert pred.update_seconds <= all_device.update_seconds


def test_resident_rows_cost_no_transfers_and_count_as_device_memory():
  p = profile(u_host=1.0, u_dev=50.0, bw=25.0)
  plan = dos_jax.ResidentFraction(0.25, then=dos_jax.Stride(2)).plan(SPEC)
  pred = costmodel.predict(p, SPEC, plan)
  rest = SubgroupSpec(18, 10**8, 18 * 10**8, 12, 2, 2)
  stride = costmodel.predict(p, rest, dos_jax.Stride(2).plan(rest))
  assert pred.resident_bytes == 6 * ROW
  assert pred.bytes_h2d == pytest.approx(stride.bytes_h2d)  # the resident rows add none
  # Per subgroup in stream regions: every streamed row (9 of the 18 left) at once.
  streamed = len(plan.streamed) * ROW if lowering_lib.regions_hold_every_row() else 2 * ROW
  assert pred.buffer_bytes == streamed and pred.device_peak_bytes == streamed + 6 * ROW
  assert pred.device_bytes_beside(5 * ROW) == 6 * ROW + max(5 * ROW, streamed)


def test_migration_cost_counts_each_moved_row_once_on_its_link():
  p = profile(u_host=1.0, u_dev=50.0, bw=25.0)
  old = dos_jax.Stride(2).plan(SPEC)
  new = dos_jax.Resident(4, then=dos_jax.Stride(2)).plan(SPEC)
  m = costmodel.migration(p, SPEC, old, new)
  before = {g: t for t, ids in (('s', old.streamed), ('h', old.host)) for g in ids}
  after = {g: t for t, ids in (('s', new.streamed), ('h', new.host), ('r', new.resident))
           for g in ids}
  moved = [g for g in range(SPEC.num_subgroups) if before[g] != after[g]]
  assert m.subgroups == len(moved)
  # A row that only changes path (host <-> streamed) keeps its buffer: only the rows
  # becoming resident are copied.
  assert m.bytes_h2d == ROW * sum(after[g] == 'r' for g in moved)
  assert m.bytes_d2h == 0
  np.testing.assert_allclose(m.seconds, m.bytes_h2d / (p.h2d_gbps * 1e9), rtol=1e-12)
  assert costmodel.migration(p, SPEC, new, new).subgroups == 0


# The llama3-* presets carry Meta's names (Llama 3.2 "1B" counts 1.24B); tests/test_hf.py
# checks them against transformers' own models instead.
@pytest.mark.parametrize('name', [n for n in model_shapes.PRESETS
                                  if n != 'tiny' and not n.startswith('llama')])
def test_preset_names_match_their_sizes(name):
  scale = {'m': 1e6, 'b': 1e9}[name[-1]]
  assert model_shapes.preset(name).num_params() == pytest.approx(float(name[:-1]) * scale,
                                                                  rel=0.04)


def test_plan_cli_13b_auto_at_or_below_every_listed_plan(capsys):
  from dos_jax import cli  # pylint: disable=import-outside-toplevel
  # XLA's attention: the paper's flash attention (the default) lets AllDevice fit.
  assert cli.main(['plan', '--model', '13b', '--profile', 'h100-pcie5', '--attention', 'xla']) == 0
  out = capsys.readouterr().out
  rows = dict(re.findall(r'^  (\S.*?)\s{2,}([\d,.]+) ms', out, re.M))
  assert {'AllHost', 'Stride(2)', 'AllDevice (no fit)'} <= set(rows)
  assert any(k.endswith('(best resident-only)') for k in rows)
  # Among the plans that fit: AllDevice does not beside the activations of the
  # runner's unfused attention (the float32 scores of 40 heads at 2048 tokens).
  ms = {k: float(v.replace(',', '')) for k, v in rows.items() if not k.endswith('(no fit)')}
  assert all(ms['Auto (chosen)'] <= v for v in ms.values()), ms


def test_plan_cli_says_why_when_auto_is_slower(capsys):
  from dos_jax import cli  # pylint: disable=import-outside-toplevel
  assert cli.main(['plan', '--model', '13b', '--device-memory', '40GB', '--seq-len', '1024']) == 0
  out = capsys.readouterr().out
  assert re.search(r'chosen plan: \d+/33 subgroups resident on device, \d+ subgroups streamed', out)
  assert 'AllDevice (no fit)' in out
  assert re.search(r'why Auto is slower than:\n  AllDevice would take .* but needs [\d.]+ GiB', out)


def test_shortfalls_name_the_memory_and_amount():
  shape = model_shapes.preset('70b')
  size = memory.sizing(shape, param_bytes=2, state_bytes=12, devices=1, seq_len=2048,
                       micro_batch=1)
  (short,) = memory.shortfalls(size, devices=1, device_bytes=80e9, host_bytes=0,
                               device_is_host=False)
  assert short.needed == size.params + size.grads + size.activations
  assert re.fullmatch(r'device memory \(each of 1\) short by [\d,.]+ GiB: needs .* available',
                      short.line())
  assert memory.shortfalls(size, devices=1, device_bytes=1e15, host_bytes=1e15,
                           device_is_host=True) == []


def test_train_refuses_a_model_that_cannot_fit_before_compiling_writing_nothing(
    tmp_path, tmp_path_factory):
  """The memory check comes before any work: the run compiles nothing (its compilation
  cache, where every compile is stored, stays empty) and writes nothing."""
  total = memory.host_available_bytes()
  if not 0 < total < 1e12:
    pytest.skip('this machine could hold a 70B model in host memory')
  cache = tmp_path_factory.mktemp('refusal-cache')
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  proc = subprocess.run(
      [sys.executable, '-c', 'import sys; from dos_jax import cli; sys.exit(cli.main())',
       'train', '--set', 'model.preset=70b', '--set', f'train.out_dir={tmp_path}/run'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and re.search(r'model.preset=70b .* short by [\d,.]+ GiB', lines[0])
  assert list(cache.rglob('*-cache*')) == [] and list(tmp_path.iterdir()) == []


def test_runner_gives_auto_the_device_budget_of_its_run(seed):
  """`dos-jax train` with `offload.policy=auto` hands Auto the same budget as the memory
  check (device memory less margin, params and grads) and the activations, so a run
  whose state fits keeps subgroups resident; on the CPU backend Auto gets none."""
  import jax  # pylint: disable=import-outside-toplevel
  from dos_jax.train import config  # pylint: disable=import-outside-toplevel
  from dos_jax.train import optimizer  # pylint: disable=import-outside-toplevel

  devices = jax.devices()[:1]
  cfg = config.load(None, ['offload.policy=auto', 'model.preset=125m'])
  optimizer.budget_auto(cfg, devices)
  assert cfg.offload.placement.budget_bytes is None  # CPU: the device is the host.

  cfg = config.load(None, ['offload.policy=auto', 'model.preset=125m'])
  device_bytes = float(np.random.default_rng(seed).uniform(8, 80)) * 2**30
  optimizer.budget_auto(cfg, devices, device_bytes)
  auto_policy = cfg.offload.placement
  size = memory._run_sizing(cfg, 1)  # pylint: disable=protected-access
  assert auto_policy.budget_bytes == pytest.approx(memory.device_budget(device_bytes, size))
  assert auto_policy.activation_bytes == pytest.approx(size.activations)
  # The 125M state (1.5 GB) fits beside the model in 8+ GiB: Auto keeps it all resident.
  spec = SubgroupSpec(num_subgroups=13, subgroup_size=10**7, num_elements=size.num_elements,
                      state_bytes_per_element=12, param_bytes_per_element=2,
                      grad_bytes_per_element=2)
  auto_policy._profile = profile(u_host=1.0, u_dev=50.0, bw=25.0)  # pylint: disable=protected-access
  plan = auto_policy.plan(spec)
  assert len(plan.resident) == spec.num_subgroups, plan.describe()
