"""One decision, every process (`dos_jax.train.agree`): `Auto` takes process 0's profile
and plans and re-plans on measurements reduced over the processes; with one process
nothing is exchanged or calibrated. Two real processes (joined through the project's
variables) given different profiles and plans both end with process 0's."""

import dataclasses
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import dos_jax
from dos_jax.planner import auto
from dos_jax.planner import costmodel
from dos_jax.planner import hardware
from dos_jax.policies import SubgroupSpec
from dos_jax.train import agree

SPEC = SubgroupSpec(num_subgroups=9, subgroup_size=65536, num_elements=9 * 65536 - 100,
                    state_bytes_per_element=8, param_bytes_per_element=4,
                    grad_bytes_per_element=4)
# A fast link beside a slow host streams part of the state; a fast host takes it all.
LINKS = dataclasses.replace(hardware.H100_PCIE_GEN5_NODE, name='links', source='test',
                            host_adamw_gparams_by_threads={1: 0.05},
                            h2d_gbps=2.0, d2h_gbps=2.0, both_gbps=1.0)
HOST = dataclasses.replace(LINKS, name='host', host_adamw_gparams_by_threads={1: 1.0},
                           h2d_gbps=1.0, d2h_gbps=1.0, both_gbps=0.5)


def test_the_two_profiles_choose_differently():
  plans = [auto.Auto(p).plan(SPEC) for p in (LINKS, HOST)]
  assert plans[0] != plans[1] and plans[0].streamed and plans[0].host


def test_one_process_exchanges_and_calibrates_nothing(monkeypatch):
  policy = dos_jax.Auto()
  # Calibrating would be a cost: make it fail loudly if anything tried.
  from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(calibrate, 'cached_profile', lambda **_: pytest.fail('calibrated'))
  assert agree.auto(policy) is None and policy.agreement is None
  assert agree.shared_profile() is None
  assert agree.max_counts(3, 7) == (3, 7) and agree.max_seconds(1.5) == 1.5


class _AsProcess1:
  """What process 1 sees: process 0 has LINKS, another plan, and slower steps."""

  def __init__(self, plan0):
    self.plan0 = plan0
    self.asked = []
    self.local_seconds = []

  def profile(self, own):
    assert own is None  # Auto() has not calibrated: the agreement reads the cache
    return LINKS, HOST

  def plan(self, plan, *, own=None):
    self.asked.append((plan, own))
    return self.plan0

  def seconds(self, value):
    self.local_seconds.append(value)
    return 10 * value  # process 0 took ten times as long

  def counts(self, rollbacks, steps):
    return max(rollbacks, 5), steps


def test_auto_takes_process_0s_profile_plan_and_reduced_measurements():
  plan0 = dos_jax.AllHost().plan(SPEC)
  agreement = _AsProcess1(plan0)
  policy = dos_jax.Auto(patience=2, warmup=0)
  policy.agree(agreement)
  assert policy.profile is LINKS
  assert policy.plan(SPEC) == plan0
  # It asked with the plan of the shared profile, and said what its own would choose.
  shared_choice = auto.Auto(LINKS).plan(SPEC)
  assert agreement.asked == [(shared_choice, auto.Auto(HOST).plan(SPEC))]
  # Each local time equals the prediction; reduced (x10) they depart, and Auto re-plans
  # after `patience` of them, as every process does with the same reduced values.
  predicted = costmodel.predict(LINKS, SPEC, plan0).update_seconds
  for _ in range(2):
    policy.observe(plan0, predicted)
  assert agreement.local_seconds == [predicted, predicted]
  assert policy.replans == 1
  assert len(agreement.asked) == 2 and agreement.asked[1][1] is None  # re-plans: no own
  policy.observe_rollbacks(0, 10)
  assert policy.clip_rate == 0.5


_PROBE = textwrap.dedent('''
    import dataclasses, jax, sys
    from dos_jax.train import agree, distributed
    from dos_jax.planner import hardware
    from dos_jax.policies import Plan
    distributed.initialize_from_env()
    rank = jax.process_index()
    base = hardware.H100_PCIE_GEN5_NODE
    own = base if rank == 0 else dataclasses.replace(base, h2d_gbps=1.0)
    a = agree.Agreement(stream=sys.stdout)
    shared, mine = a.profile(own)
    plan = Plan(streamed=(0,), host=(1, 2)) if rank == 0 else Plan(streamed=(), host=(0, 1, 2))
    got = a.plan(plan)
    print('RESULT', rank, shared == base, mine == own, got.streamed, got.host,
          a.seconds(1.0 + rank), a.counts(rank, 4))
''')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_end_with_process_0s_profile_and_plan(tmp_path):
  script = tmp_path / 'probe.py'
  script.write_text(_PROBE)
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_PROCESSES='2',
             XLA_FLAGS='--xla_force_host_platform_device_count=1',
             JAX_COORDINATOR_ADDRESS=f'localhost:{_free_port()}')
  procs = [subprocess.Popen([sys.executable, str(script)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(env, JAX_PROCESS_ID=str(rank)))
           for rank in range(2)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=180))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, (_, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-2000:]
  results = [[l for l in out.splitlines() if l.startswith('RESULT')] for out, _ in outputs]
  assert results == [['RESULT 0 True True (0,) (1, 2) 2.0 (1, 4)'],
                     ['RESULT 1 True True (0,) (1, 2) 2.0 (1, 4)']]
  said = [l for l in outputs[1][0].splitlines() if l.startswith('dos-jax: process 1:')]
  assert len(said) == 1 and 'takes process 0\'s plan' in said[0]
  assert not [l for l in outputs[0][0].splitlines() if l.startswith('dos-jax: process')]
