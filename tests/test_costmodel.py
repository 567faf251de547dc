"""The cost model: profiles, predictions against hand-derived formulas, the paper's rule."""

import dataclasses
import json
import math

import numpy as np
import pytest

from dos_jax import lowering as lowering_lib
from dos_jax.planner import costmodel
from dos_jax.planner.costmodel import HardwareProfile
from dos_jax.policies import AllDevice
from dos_jax.policies import AllHost
from dos_jax.policies import Plan
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec


def synthetic(**overrides) -> HardwareProfile:
  fields = dict(
      name='synthetic', h2d_gbps=20.0, d2h_gbps=18.0, both_gbps=15.0,
      host_adamw_gparams_by_threads={1: 0.5, 8: 2.0}, device_adamw_gparams=50.0,
      device_free_bytes=40e9, host_copy_slowdown=1.0, device_is_host=False,
  )
  fields.update(overrides)
  return HardwareProfile(**fields)


def spec_of(num_elements: int, subgroup: int, sb=12, pb=2, gb=2) -> SubgroupSpec:
  return SubgroupSpec(math.ceil(num_elements / subgroup), subgroup, num_elements, sb, pb, gb)


@pytest.mark.parametrize('profile', [costmodel.H100_PCIE_GEN5_NODE, costmodel.A100_PCIE_GEN4_NODE, synthetic()])
def test_profile_json_round_trip(profile, tmp_path):
  path = tmp_path / 'sub' / 'p.json'
  text = profile.to_json(path)
  assert json.loads(text) == json.loads(path.read_text())
  again = HardwareProfile.from_json(path)
  assert again == profile
  assert hash(again) == hash(profile)


def test_presets_cite_sources():
  for profile in costmodel.PROFILE_PRESETS.values():
    assert 'paper' in profile.source
    assert 'PCIe' in profile.source


@pytest.mark.parametrize(
    'field, value', [('h2d_gbps', 0.0), ('both_gbps', float('inf')), ('host_copy_slowdown', 0.5),
                     ('device_adamw_gparams', -1.0), ('host_adamw_gparams_by_threads', {})]
)
def test_profile_rejects_bad_numbers_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    synthetic(**{field: value})


def test_from_json_names_file_and_unknown_key(tmp_path):
  data = synthetic().to_dict()
  data['pcie_gen'] = 5
  path = tmp_path / 'bad.json'
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=r'bad\.json.*pcie_gen'):
    HardwareProfile.from_json(path)
  with pytest.raises(ValueError, match='not found'):
    HardwareProfile.from_json(tmp_path / 'missing.json')


def test_host_throughput_by_threads():
  p = synthetic()
  assert p.host_adamw_gparams() == 2.0
  assert dataclasses.replace(p, host_threads=1).host_adamw_gparams() == 0.5
  with pytest.raises(ValueError, match='host_threads'):
    dataclasses.replace(p, host_threads=3)


def test_all_host_by_hand(seed):
  """AllHost on an accelerator: grads out, host AdamW, params back, pipelined by subgroup."""
  rng = np.random.default_rng(seed)
  p = synthetic(host_adamw_gparams_by_threads={4: rng.uniform(0.5, 3)})
  n = int(rng.integers(3 * 10**6, 9 * 10**6))
  spec = spec_of(n, 10**6)
  pred = costmodel.predict(p, spec, AllHost().plan(spec))
  rows = spec.num_subgroups * 10**6  # the core moves and updates whole rows, padding too
  grads = 2 * rows / (p.d2h_gbps * 1e9)  # nothing on the device: each link alone
  params = 2 * rows / (p.h2d_gbps * 1e9)
  work = rows / (p.host_adamw_gparams() * 1e9)
  last = 10**6
  host = grads * 10**6 / rows + max(grads, work, params) + 2 * last / (p.h2d_gbps * 1e9)
  np.testing.assert_allclose(pred.host_seconds, host, rtol=1e-12)
  # Around the paths: no gradient is packed on the device (host rows are assembled on
  # the host), output rows written (2 B), new rows unpacked onto the params (2 + 2 + 2
  # B), at the device's AdamW memory bandwidth.
  layout = n * 8 / (28 * p.device_adamw_gparams * 1e9)
  np.testing.assert_allclose(pred.layout_seconds, layout, rtol=1e-12)
  np.testing.assert_allclose(pred.update_seconds, host + layout, rtol=1e-12)
  assert pred.bytes_h2d == 2 * rows and pred.bytes_d2h == 2 * rows
  assert pred.device_peak_bytes == 0


def test_device_only_single_buffer_serializes_each_subgroup():
  p = synthetic()
  spec = spec_of(5 * 10**6, 10**6)
  pred = costmodel.predict(p, spec, Stride(1, buffers=1).plan(spec))
  per = 12e6 / (p.h2d_gbps * 1e9) + 1e6 / (p.device_adamw_gparams * 1e9) + 12e6 / (p.d2h_gbps * 1e9)
  np.testing.assert_allclose(pred.device_stream_seconds, 5 * per, rtol=1e-12)
  # With no host subgroup the step builds no stream region: one row at a time.
  assert pred.device_peak_bytes == 12e6
  # Beside a host subgroup, in stream regions, every streamed row is held until the
  # regions are done.
  mixed = Stride(2, buffers=1).plan(spec)
  held = costmodel.predict(p, spec, mixed).device_peak_bytes
  assert held == (len(mixed.streamed) * 12e6 if lowering_lib.regions_hold_every_row() else 12e6)


def test_more_buffers_pipeline_the_copies():
  p = synthetic()
  spec = spec_of(20 * 10**6, 10**6)
  one, two, three = (costmodel.predict(p, spec, Stride(1, buffers=b).plan(spec)) for b in (1, 2, 3))
  assert three.device_stream_seconds <= two.device_stream_seconds < one.device_stream_seconds
  # No host subgroup, so no stream region: the loop holds `buffers` rows.
  held = [one, two, three]
  assert [h.device_peak_bytes for h in held] == [b * 12e6 for b in (1, 2, 3)]
  # With 3 buffers both directions run at once (both_gbps): the module docstring's
  # pipeline, 20 periods of max(h, c, d, (h + c + d) / 3) plus one first subgroup's
  # latency (h + c + d) - period, in float64 from the profile's figures.
  h = d = 12e6 / 15e9
  c = 1e6 / 50e9
  period = max(h, c, d, (h + c + d) / 3)
  np.testing.assert_allclose(three.device_stream_seconds, 20 * period + (h + c + d - period),
                             rtol=1e-12)


def test_cpu_backend_costs_every_plan_the_one_host_call():
  """The CPU program updates every subgroup with one host call whatever the plan."""
  p = synthetic(device_is_host=True)
  spec = spec_of(8 * 10**6, 10**6)
  preds = [costmodel.predict(p, spec, policy.plan(spec))
           for policy in (Stride(2), AllHost(), AllDevice())]
  for pred in preds:
    assert pred.bound == 'serialized' and pred.bytes_h2d == pred.bytes_d2h == 0
    np.testing.assert_allclose(pred.update_seconds, preds[0].update_seconds)
    np.testing.assert_allclose(
        pred.host_seconds, spec.num_elements / (p.host_adamw_gparams() * 1e9))


def test_resident_plan_moves_nothing():
  p = synthetic()
  spec = spec_of(3 * 10**6, 10**6)
  pred = costmodel.predict(p, spec, AllDevice().plan(spec))
  assert pred.bytes_h2d == pred.bytes_d2h == 0
  np.testing.assert_allclose(pred.update_seconds - pred.layout_seconds, 3e6 / 50e9)
  assert pred.device_peak_bytes == 12 * 3e6


def test_gradient_copies_hide_behind_backward():
  p = synthetic()
  spec = spec_of(10 * 10**6, 10**6)
  plan = AllHost().plan(spec)
  grads = 2 * 10**7 / (p.d2h_gbps * 1e9)
  none = costmodel.predict(p, spec, plan)
  half = costmodel.predict(p, spec, plan, backward_seconds=grads / 2)
  full = costmodel.predict(p, spec, plan, backward_seconds=10 * grads)
  assert none.grad_transfer_hidden_seconds == 0
  np.testing.assert_allclose(half.grad_transfer_hidden_seconds, grads / 2)
  np.testing.assert_allclose(full.grad_transfer_hidden_seconds, grads)
  assert full.update_seconds <= half.update_seconds <= none.update_seconds
  it = costmodel.predict_iteration(p, spec, plan, forward_seconds=0.1, backward_seconds=0.2)
  np.testing.assert_allclose(it.iteration_seconds, 0.3 + it.update.update_seconds)


def test_host_copy_slowdown_costs_only_while_copies_run():
  spec = spec_of(40 * 10**6, 10**6)
  plan = Stride(4).plan(spec)
  calm = costmodel.predict(synthetic(), spec, plan)
  busy = costmodel.predict(synthetic(host_copy_slowdown=1.5), spec, plan)
  assert calm.host_seconds < busy.host_seconds < 1.5 * calm.host_seconds


def test_fp32_params_are_their_own_master():
  """fp32 params: no master on the host, so host subgroups pull params with the grads
  (assembled into rows on the host, not on the device)."""
  p = synthetic()
  bf16, fp32 = spec_of(4 * 10**6, 10**6, sb=12, pb=2, gb=2), spec_of(4 * 10**6, 10**6, sb=8, pb=4, gb=4)
  assert costmodel.master_kept(bf16) and not costmodel.master_kept(fp32)
  assert costmodel.host_pull_bytes(bf16) == 2 and costmodel.host_pull_bytes(fp32) == 8
  pred = costmodel.predict(p, fp32, AllHost().plan(fp32))
  assert pred.bytes_d2h == 8 * 4e6 and pred.bytes_h2d == 4 * 4e6
  np.testing.assert_allclose(pred.layout_seconds, 4e6 * (4 + 12) / (28 * 50e9))
  streamed = costmodel.predict(p, fp32, Stride(1).plan(fp32))
  np.testing.assert_allclose(streamed.layout_seconds, 4e6 * (8 + 8 + 4 + 12) / (28 * 50e9))


def test_plan_and_spec_must_agree():
  spec = spec_of(4 * 10**6, 10**6)
  with pytest.raises(ValueError, match='3 subgroups but the spec has 4'):
    costmodel.predict(synthetic(), spec, Plan(streamed=(0,), host=(1, 2)))


@pytest.mark.parametrize('u_host, bandwidth', [(2.0, 20.0), (1.0, 6.0), (3.0, 50.0), (0.5, 2.0)])
@pytest.mark.parametrize('param_bytes', [0, 2])
def test_papers_stride_rule_falls_out(u_host, bandwidth, param_bytes):
  """The paper's rule (docs/planner.md, the method, point 6): one device subgroup in k
  hides behind the host work on k-1 iff k >= 1 + 12 U/B. With 16-bit weights also
  crossing H2D for every host subgroup the rule becomes k >= 1 + 12 U / (B - pb U);
  pb = 0 is the paper's form. The best stride is the first integer past the threshold
  or the one before it."""
  p = synthetic(
      both_gbps=bandwidth, h2d_gbps=bandwidth, d2h_gbps=bandwidth,
      host_adamw_gparams_by_threads={8: u_host}, device_adamw_gparams=1e6,
  )
  spec = SubgroupSpec(840, 10**6, 840 * 10**6, 12, param_bytes, 2)
  threshold = 1 + 12 * u_host / (bandwidth - param_bytes * u_host)
  times = {}
  for k in range(1, 13):
    pred = costmodel.predict(p, spec, Stride(k, buffers=3).plan(spec), backward_seconds=1e3)
    times[k] = pred.update_seconds
    if k >= threshold * 1.1:  # margin: filling the pipeline costs one subgroup
      assert pred.bound == 'host', (k, threshold, pred)
    elif k <= threshold / 1.1:
      assert pred.bound in ('device stream', 'H2D link'), (k, threshold, pred)
  best = min(times, key=times.get)
  assert best in (math.floor(threshold), math.ceil(threshold)), (best, threshold)


def test_stream_correction_leaves_pack_and_unpack_alone():
  p = synthetic()
  spec = spec_of(16 * 10**6, 10**6)
  plan = Stride(2).plan(spec)
  base, slow = (costmodel.predict(q, spec, plan) for q in (p, p.scaled(stream=0.1)))
  assert slow.layout_seconds == base.layout_seconds
  assert slow.device_stream_seconds > 5 * base.device_stream_seconds
  host = costmodel.predict(p.scaled(host=0.5), spec, plan)
  np.testing.assert_allclose(host.host_seconds, 2 * base.host_seconds, rtol=0.05)
