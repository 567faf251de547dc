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
def test_the_timeline_keeps_the_order_the_construction_forces(policy):
  plan = policy.plan(SPEC)
  t = _timeline(plan)
  backward = t.span('backward')
  (call,) = [s for s in t.spans if s.lane == 'host']
  assert call.start >= backward.end  # the last call, grouped with the stream lanes
  if plan.streamed:
    assert t.span('device tiers').start == call.start  # one group: placed together
  assert t.span('params').start >= call.end
  assert t.seconds > max(call.end, backward.end)
  assert [e for e, _ in t.events()] == sorted(e for e, _ in t.events())


@pytest.mark.parametrize('policy', [AllHost(), Stride(2), Stride(4), DeviceFraction(0.25)],
                         ids=repr)
def test_one_chunk_agrees_with_the_roofline_within_ten_percent(policy):
  """Unchunked, the timeline and `predict_iteration` describe one step two ways (the
  roofline takes the slowest resource, the timeline the order of the work): they agree
  within 10%."""
  plan = policy.plan(SPEC)
  t = _timeline(plan)
  roofline = costmodel.predict_iteration(PROFILE, SPEC, plan, forward_seconds=FORWARD,
                                         backward_seconds=BACKWARD)
  assert t.seconds == pytest.approx(roofline.iteration_seconds, rel=0.1)


def test_the_docstring_example_runs():
  failures, tried = doctest.testmod(timeline_lib, verbose=False)
  assert tried > 0 and failures == 0
