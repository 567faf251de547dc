"""One run per disk tier's state folder (`offload.disk_dir`), by the run folder's lock.

Two runs with different run folders and the same `offload.disk_dir` used to overwrite
each other's state files. The second is now refused at once (exit 2, one line naming
`offload.disk_dir`, the PID, host and run folder of the run that holds it) before it
writes anything, and the first ends exactly as it would alone. A lock left by a process
that died (SIGKILL) is taken over, with one line saying so.
"""

import hashlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from dos_jax.kernels import host_adamw_disk
from dos_jax.train import rundir
from tests.test_faults import _outcome
from tests.test_faults import _start
from tests.test_faults import _stop_when
from tests.test_faults import _train
from tests.test_faults import jax_cache  # pylint: disable=unused-import  (the fixture)
from tests.test_faults import reference  # pylint: disable=unused-import  (the fixture)
from tests.test_runner_reliability import dataset  # pylint: disable=unused-import  (the fixture)

pytestmark = pytest.mark.skipif(not host_adamw_disk.disk_kernel_available(),
                                reason='the native disk kernel is not built')

_HOLD = '''
import sys, time
from dos_jax.train import rundir
lock = rundir.RunLock(sys.argv[1], key='offload.disk_dir', name=rundir.STATE_LOCK_FILE,
                      run_dir=sys.argv[2])
print('held', flush=True)
time.sleep(600)
'''


def _holder(state, run_dir) -> subprocess.Popen:
  """A process that holds `state`'s lock, as a run on it does, until it is killed."""
  proc = subprocess.Popen([sys.executable, '-c', _HOLD, state, run_dir],
                          stdout=subprocess.PIPE, text=True,
                          env={**os.environ, 'PYTHONPATH': os.getcwd()})
  assert proc.stdout.readline().strip() == 'held'
  return proc


def _files(folder) -> dict[str, str]:
  """Each file under `folder` and the sha256 of its bytes."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def test_a_run_on_a_busy_state_folder_exits_2_naming_the_key_and_writes_nothing(
    dataset, tmp_path, capsys):
  state, other = str(tmp_path / 'state'), str(tmp_path / 'other-run')
  proc = _holder(state, other)
  try:
    before = _files(state)
    out = tmp_path / 'run'
    code, err = _train(dataset, str(out), capsys, f'offload.disk_dir={state}')
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f'dos-jax: error: --set offload.disk_dir={state}: offload.disk_dir: {state} is in'
        f' use by another run (pid {proc.pid}'
        f' on host {socket.gethostname()}, since {_since(state)}, run {other}); wait for it'
        ' to end or set another offload.disk_dir'], err
    assert not out.exists()
    assert _files(state) == before
  finally:
    proc.kill()
    proc.wait()


def _since(state) -> str:
  import json  # pylint: disable=import-outside-toplevel
  with open(os.path.join(state, rundir.STATE_LOCK_FILE), encoding='utf-8') as f:
    return json.load(f)['since']


def test_a_dead_runs_state_lock_is_taken_over_in_one_line(dataset, tmp_path, capsys):
  state = str(tmp_path / 'state')
  proc = _holder(state, str(tmp_path / 'dead-run'))
  since = _since(state)
  proc.kill()
  proc.wait()
  assert os.path.exists(os.path.join(state, rundir.STATE_LOCK_FILE))  # left by the kill
  code, err = _train(dataset, str(tmp_path / 'run'), capsys, f'offload.disk_dir={state}',
                     'train.steps=1', 'checkpoint.every=0')
  assert code == 0, err[-3000:]
  lines = [line for line in err.splitlines() if 'took over' in line]
  assert lines == [f'offload.disk_dir: {state}: took over the lock left by pid {proc.pid} on'
                   f' host {socket.gethostname()}, since {since}, run {tmp_path / "dead-run"},'
                   ' which ended without releasing it'], err[-3000:]
  assert not os.path.exists(os.path.join(state, rundir.STATE_LOCK_FILE))  # released


@pytest.mark.slow
def test_two_runs_on_one_state_folder_the_second_exits_2_and_the_first_is_untouched(
    dataset, reference, jax_cache, tmp_path, capsys):
  """The fault as it was found: two runs, different run folders, one disk_dir. The first
  is stopped (SIGSTOP) after a step; the second is refused without touching a byte of
  the state folder; the first, let go on, ends exactly where an uninterrupted run does
  (with or without a disk tier: tests/test_disk_runner.py)."""
  state, first_out = str(tmp_path / 'state'), str(tmp_path / 'first')
  metrics = os.path.join(first_out, 'metrics.jsonl')
  proc = _start(dataset, first_out, jax_cache, f'offload.disk_dir={state}')
  try:
    _stop_when(proc, lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0,
               'the first step')
    before, first_before = _files(state), _files(first_out)
    second = tmp_path / 'second'
    code, err = _train(dataset, str(second), capsys, f'offload.disk_dir={state}')
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f'dos-jax: error: --set offload.disk_dir={state}: offload.disk_dir: {state} is in'
        f' use by another run (pid {proc.pid} on host {socket.gethostname()},'), err
    assert lines[0].endswith(f', run {first_out}); wait for it to end or set another'
                             ' offload.disk_dir'), lines
    assert not second.exists()
    assert _files(state) == before and _files(first_out) == first_before
  finally:
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 0, err[-3000:]
  assert _outcome(first_out) == reference['outcome']
  assert not os.path.exists(os.path.join(state, rundir.STATE_LOCK_FILE))
