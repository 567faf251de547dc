"""The step timeline (`dos_jax.planner.timeline`): the order the construction forces,
and agreement with the roofline `predict` where both describe the same step."""

import doctest

import pytest

from dos_jax.planner import costmodel
from dos_jax.planner import timeline as timeline_lib
from dos_jax.policies import AllHost
from dos_jax.policies import DeviceFraction
from dos_jax.policies import Stride
from dos_jax.policies import SubgroupSpec

PROFILE = costmodel.PROFILE_PRESETS['h100-pcie5']
SPEC = SubgroupSpec(num_subgroups=16, subgroup_size=10**8, num_elements=16 * 10**8,
                    param_bytes_per_element=2, grad_bytes_per_element=2)
FORWARD, BACKWARD = 0.5, 1.0


def _timeline(plan, **kwargs):
  return timeline_lib.timeline(PROFILE, SPEC, plan, forward_seconds=FORWARD,
                               backward_seconds=BACKWARD, **kwargs)


@pytest.mark.parametrize('policy', [AllHost(), Stride(2), Stride(4), DeviceFraction(0.25)],
                         ids=repr)
@pytest.mark.parametrize('chunks', [1, 2, 4])
@pytest.mark.parametrize('clipped', [True, False])
def test_the_timeline_keeps_the_order_the_construction_forces(policy, chunks, clipped):
  plan = policy.plan(SPEC)
  t = _timeline(plan, chunks=chunks, clipped=clipped)
  backward = t.span('backward')
  calls = [s for s in t.spans if s.lane == 'host']
  parts = [s for s in t.spans if s.name.startswith('device part')]
  assert calls and len(calls) <= chunks
  for a, b in zip(calls, calls[1:]):
    assert b.start >= a.end  # one host call at a time (the link)
  for part in parts:
    assert part.start >= backward.end
  for k, call in enumerate(calls, 1):
    if clipped:
      assert call.start >= backward.end  # the clip factor needs every gradient
    params = t.span(f'params {k}')
    assert params.start >= call.end
    later = [p for p in parts if int(p.name.split()[-1]) > k]
    assert all(p.start >= call.end for p in later)  # the done blocks the launch thread
  assert t.seconds > max([c.end for c in calls] + [p.end for p in parts] + [backward.end])
  assert [e for e, _ in t.events()] == sorted(e for e, _ in t.events())


def test_without_clipping_the_first_chunk_starts_during_the_backward_pass():
  plan = Stride(2).plan(SPEC)
  early = _timeline(plan, chunks=4, clipped=False).span('host call 1')
  late = _timeline(plan, chunks=4, clipped=True).span('host call 1')
  assert early.start < FORWARD + BACKWARD <= late.start


@pytest.mark.parametrize('policy', [AllHost(), Stride(2), Stride(4), DeviceFraction(0.25)],
                         ids=repr)
def test_one_chunk_agrees_with_the_roofline_within_ten_percent(policy):
  """Unchunked, the timeline and `predict_iteration` describe one step two ways (the
  roofline takes the slowest resource, the timeline the order of the work): they agree
  within 10%."""
  plan = policy.plan(SPEC)
  t = _timeline(plan, chunks=1)
  roofline = costmodel.predict_iteration(PROFILE, SPEC, plan, forward_seconds=FORWARD,
                                         backward_seconds=BACKWARD)
  assert t.seconds == pytest.approx(roofline.iteration_seconds, rel=0.1)


def test_bad_chunk_count_is_one_clear_error():
  with pytest.raises(ValueError, match='chunks must be >= 1, got 0'):
    _timeline(Stride(2).plan(SPEC), chunks=0)


def test_the_docstring_example_runs():
  failures, tried = doctest.testmod(timeline_lib, verbose=False)
  assert tried > 0 and failures == 0
