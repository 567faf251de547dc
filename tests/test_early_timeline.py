"""Early host calls in the planner: `timeline.early_timeline`, `choose_early_calls`,
`Auto.early_calls`, `dos-jax plan`'s line, and the runner's pinned pool.

The model's inputs are presets and round numbers (no randomness): a 70-subgroup model on
the h100-pcie5 profile, whose AllHost step is host-bound and whose Stride(2) step is
bound by the stream.
"""

import subprocess
import sys

import pytest

import dos_jax
from dos_jax.geometry import partition as partition_lib
from dos_jax.step import early_calls
from dos_jax.planner import costmodel
from dos_jax.planner import timeline
from dos_jax.policies import AllHost
from dos_jax.policies import SubgroupSpec
from dos_jax.train import config as config_lib
from dos_jax.train import configlib

PROFILE = costmodel.PROFILE_PRESETS['h100-pcie5']
SPEC = SubgroupSpec(num_subgroups=70, subgroup_size=10**8, num_elements=70 * 10**8)
TIMES = dict(forward_seconds=1.0, backward_seconds=2.0)


def test_split_takes_sizes_in_backward_order_and_keeps_a_last_call():
  assert partition_lib.host_calls([9, 7, 5, 3, 1], 2) == [[9, 7, 5], [3, 1]]
  assert partition_lib.host_calls([9, 7, 5, 3, 1], (1, 2)) == [[9], [7, 5], [3, 1]]
  assert partition_lib.host_calls([9, 7, 5], (1, 2)) == [[9], [7, 5]]  # the last call is 7, 5
  assert partition_lib.host_calls([9, 7, 5], (5,)) == [[9, 7, 5]]


def test_the_timeline_takes_the_host_rows_in_the_steps_order():
  """`timeline.host_order` is the order the step's host calls take the host blocks
  (`early_calls.host_blocks`): the last first, the rows without weight decay last. Those
  arrive once the backward pass is over, so an early call that held one would start
  then: with them last the first early call starts during the backward pass."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from dos_jax.geometry import partition  # pylint: disable=import-outside-toplevel
  spec = dataclasses.replace(SPEC, decayed_rows=68)  # rows 68 and 69: the norm scales
  plan = AllHost().plan(spec)
  part = partition.for_plan(plan, two_memories=True)
  blocks = part.blocks(partition.Tier.HOST)
  want = [blocks[b][0] for b in early_calls.host_blocks(part, spec.decayed_rows)]
  assert timeline.host_order(spec, plan) == want
  assert want[-2:] == [69, 68] and want[0] == 67
  early = timeline.early_timeline(PROFILE, spec, plan, early=(2, 2), **TIMES)
  assert early.span('early call 1').start < 3.0  # during the backward pass
  # A norm row's gradients are in host memory only once the backward pass is over
  # (3 s); the last subgroup, were it a matrix, would be there right after the forward.
  only = dos_jax.Plan(streamed=tuple(range(69)), host=(69,))
  starts = [timeline.gradient_arrivals(PROFILE, s, only, TIMES['forward_seconds'],
                                      TIMES['backward_seconds'])[0][69] for s in (spec, SPEC)]
  assert starts[0] >= 3.0 > 1.5 > starts[1], starts


def test_early_calls_start_during_the_backward_pass_and_one_call_is_the_timeline():
  plan = AllHost().plan(SPEC)
  one = timeline.early_timeline(PROFILE, SPEC, plan, early=1, **TIMES)
  assert one.span('last call').start >= 3.0  # after forward + backward
  early = timeline.early_timeline(PROFILE, SPEC, plan, early=(1,) * 4, **TIMES)
  assert all(early.span(f'early call {k}').start < 3.0 for k in range(1, 5))
  assert early.seconds < one.seconds
  redo = timeline.early_timeline(PROFILE, SPEC, plan, early=(1,) * 4, rollback=True, **TIMES)
  assert redo.seconds >= early.seconds
  assert redo.span('last call and redo').end > early.span('last call').end


def test_the_choice_weighs_the_clip_rate():
  plan = AllHost().plan(SPEC)
  calm, seconds = timeline.choose_early_calls(PROFILE, SPEC, plan, clip_rate=0.0, **TIMES)
  one = timeline.timeline(PROFILE, SPEC, plan, **TIMES).seconds
  assert calm and seconds < one
  mean = timeline.expected_early_seconds(PROFILE, SPEC, plan, early=calm, clip_rate=0.5,
                                         **TIMES)
  fired = timeline.early_timeline(PROFILE, SPEC, plan, early=calm, rollback=True,
                                  **TIMES).seconds
  assert mean == pytest.approx(0.5 * seconds + 0.5 * fired)
  always, _ = timeline.choose_early_calls(PROFILE, SPEC, plan, clip_rate=1.0, **TIMES)
  assert sum(always) <= sum(calm)
  with pytest.raises(ValueError, match='clip_rate'):
    timeline.expected_early_seconds(PROFILE, SPEC, plan, early=2, clip_rate=2.0, **TIMES)


def test_auto_chooses_early_calls_from_its_backward_pass_and_measured_clip_rate():
  plan = AllHost().plan(SPEC)
  auto = dos_jax.Auto(PROFILE, backward_seconds=2.0, clip_rate=0.0)
  assert auto.early_calls(SPEC, plan)
  # No backward pass known: no choice, the state takes the fixed rule
  # (`partition.early_host_calls`).
  assert dos_jax.Auto(PROFILE).early_calls(SPEC, plan) is None
  auto.observe_rollbacks(10, 10)
  assert auto.clip_rate == 1.0
  assert sum(auto.early_calls(SPEC, plan)) <= sum(
      dos_jax.Auto(PROFILE, backward_seconds=2.0, clip_rate=0.0).early_calls(SPEC, plan))
  with pytest.raises(ValueError, match='clip_rate'):
    dos_jax.Auto(PROFILE, clip_rate=1.5)


def test_plan_prints_the_gain_of_early_host_calls():
  out = subprocess.run([sys.executable, '-m', 'dos_jax.cli', 'plan', '--model', '7b'],
                       capture_output=True, text=True, check=True).stdout
  line = next(l for l in out.splitlines() if l.startswith('AllHost as the step runs it'))
  assert 'early host calls' in line and 'rolls back' in line and 'x)' in line, line
  bad = subprocess.run([sys.executable, '-m', 'dos_jax.cli', 'plan', '--model', '7b',
                        '--clip-rate', '2'], capture_output=True, text=True)
  assert bad.returncode == 2 and '--clip-rate' in bad.stderr, bad.stderr


def test_the_construction_keys_are_gone_from_the_runner_config():
  """The early host calls are the library's choice (issue 40): no config key."""
  with pytest.raises(configlib.ConfigError, match='offload.early_chunks: unknown key'):
    configlib.from_dict(config_lib.OffloadConfig, {'early_chunks': 3}, key='offload')


def test_the_pinned_pool_counts_the_undo_where_early_calls_may_speculate():
  from dos_jax.planner import memory  # pylint: disable=import-outside-toplevel
  size = lambda *sets: memory.run_pinned_bytes(config_lib.load(None, list(sets)))
  cfg = config_lib.load(None, [])  # the packaged tiny config
  state_bytes = 12 if str(cfg.model.param_dtype) in ('bfloat16', 'float16') else 8
  undo = state_bytes * cfg.model.shape().num_params()
  off = size('offload.policy=auto', 'optim.clip_norm=null')  # nothing to speculate
  assert size('offload.policy=auto') == off + undo
  assert size('offload.policy=stride') == off + undo  # a GPU run gets early calls
  assert size('offload.policy=stride', 'offload.platform=gpu') == off + undo
  assert size('offload.policy=stride', 'offload.platform=cpu') == off  # one memory
  assert size('offload.policy=stride', 'optim.clip_norm=null') == off
