"""`dos-jax train` with the disk tier (`offload.disk_dir`): killed mid-run (SIGKILL, after a
checkpoint, while the disk tier's files are at a later step) and resumed, it ends
exactly (bit for bit) where the uninterrupted run without a disk tier ends; a disk that
cannot hold the state is refused in one line naming `offload.disk_dir`."""

import os
import signal

import pytest

from dos_jax.kernels import host_adamw_disk
from dos_jax.train import integrity
from dos_jax.train import rundir
from tests.test_faults import _names
from tests.test_faults import _outcome
from tests.test_faults import _rows_since_resume
from tests.test_faults import _start
from tests.test_faults import _stop_when
from tests.test_faults import _train
from tests.test_faults import EVERY
from tests.test_faults import jax_cache  # pylint: disable=unused-import  (the fixture)
from tests.test_faults import reference  # pylint: disable=unused-import  (the fixture)
from tests.test_runner_reliability import dataset  # pylint: disable=unused-import  (the fixture)

pytestmark = pytest.mark.skipif(not host_adamw_disk.disk_kernel_available(),
                                reason='the native disk kernel is not built')


@pytest.mark.slow
def test_a_killed_run_with_its_state_on_disk_resumes_exactly(
    dataset, reference, jax_cache, tmp_path, capsys):
  out = str(tmp_path / 'run')
  disk = ['offload.disk_dir=' + str(tmp_path / 'state')]
  metrics = os.path.join(out, 'metrics.jsonl')

  ckpt_dir = os.path.join(out, 'checkpoints')

  def past_a_checkpoint():  # a complete checkpoint, and a later step's files on disk
    steps = [r['step'] for r in _rows_since_resume(metrics)]
    saved = [int(n) for n in _names(ckpt_dir)
             if n.isdigit() and integrity.has_manifest(os.path.join(ckpt_dir, n))]
    return bool(steps and saved) and steps[-1] > max(saved) and steps[-1] % EVERY

  proc = _start(dataset, out, jax_cache, *disk)
  try:
    _stop_when(proc, past_a_checkpoint, 'a step past the first checkpoint')
  finally:
    proc.kill()
    proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  names = os.listdir(tmp_path / 'state')
  assert rundir.STATE_LOCK_FILE in names, names  # the killed run's, left behind
  names.remove(rundir.STATE_LOCK_FILE)
  assert names and all(n.startswith('sg') for n in names), names
  code, err = _train(dataset, out, capsys, *disk)
  assert code == 0, err[-3000:]
  assert f'resumed from {ckpt_dir} at step' in err, err[-3000:]
  # Both locks the killed run left are taken over, each in one line naming it.
  taken = [line for line in err.splitlines() if 'took over the lock left by' in line]
  assert [line.split(':')[0] for line in taken] == ['train.out_dir', 'offload.disk_dir'], taken
  assert all(f'pid {proc.pid} on host' in line for line in taken), taken
  assert not os.path.exists(os.path.join(tmp_path / 'state', rundir.STATE_LOCK_FILE))
  assert _outcome(out) == reference['outcome']


def test_a_disk_too_small_for_the_state_is_refused_naming_the_key(
    dataset, tmp_path, capsys, monkeypatch):
  from dos_jax.planner import memory  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(memory, 'disk_free_bytes', lambda directory: 1e6)
  code, err = _train(dataset, str(tmp_path / 'run'), capsys,
                     'offload.disk_dir=' + str(tmp_path / 'state'))
  assert code != 0
  lines = [line for line in err.splitlines() if 'offload.disk_dir=' in line]
  assert len(lines) == 1 and 'two generations of the state on disk' in lines[0], err[-2000:]
  assert not os.path.exists(tmp_path / 'run')


def test_resuming_a_disk_tiers_checkpoint_with_another_subgroup_size_is_one_line(
    dataset, tmp_path, capsys, monkeypatch):
  """Its checkpoints keep the state by subgroup (`dos_jax.state_to_files`): another
  subgroup size is refused, naming the key, before the checkpoint is touched. The
  disk check counts the earlier run's files: a resume needs one new generation, not
  two (the checkpoint's is linked back). The split between disk and memory may change
  (the whole state in memory at the end). The refused run is refused before it builds
  anything."""
  from dos_jax.planner import memory  # pylint: disable=import-outside-toplevel
  out, state = str(tmp_path / 'run'), str(tmp_path / 'state')
  disk = 'offload.disk_dir=' + state
  code, err = _train(dataset, out, capsys, disk, 'train.steps=2', 'offload.subgroup_size=4096')
  assert code == 0, err[-3000:]
  ckpt = os.path.join(out, 'checkpoints', '2')
  assert os.path.isdir(os.path.join(ckpt, 'subgroups')), os.listdir(ckpt)
  before = integrity.read_manifest(ckpt)
  reused, linked = memory.disk_state_bytes(state)
  generation = sum(os.path.getsize(os.path.join(state, n)) for n in os.listdir(state)
                   if n.endswith('.0'))
  assert (reused, linked) == (generation, generation)  # half 1 free, half 0 linked
  with monkeypatch.context() as patch:  # nothing free: its half 1 is less than a generation
    patch.setattr(memory, 'disk_free_bytes', lambda directory: 1.0)
    code, err = _train(dataset, out, capsys, disk, 'train.steps=3', 'offload.subgroup_size=4096')
  assert code != 0 and 'two generations of the state on disk' in err, err[-2000:]
  code, err = _train(dataset, out, capsys, disk, 'train.steps=3', 'offload.subgroup_size=2048')
  assert code == 2
  lines = [line for line in err.splitlines() if 'offload.subgroup_size' in line]
  assert len(lines) == 1 and 'keeps its disk tier\'s optimizer state by subgroup' in lines[0], err
  assert integrity.read_manifest(ckpt) == before
  monkeypatch.setattr(memory, 'disk_free_bytes', lambda directory: 0.2 * generation)
  code, err = _train(dataset, out, capsys, disk, 'train.steps=3', 'offload.subgroup_size=4096')
  assert code == 0 and 'resumed from' in err, err[-3000:]
  code, err = _train(dataset, out, capsys, 'train.steps=4', 'offload.subgroup_size=4096')
  assert code == 0 and 'resumed from' in err, err[-3000:]


@pytest.mark.slow
def test_a_zero3_run_keeps_each_devices_state_on_disk_and_resumes_in_its_packing(
    dataset, tmp_path, capsys, monkeypatch):
  """The two-memory program (`offload.platform=gpu` on the CPU backend) on the 8 devices
  as mesh.fsdp=4 (x data 2): the state packed shard-major over `fsdp`, each device with
  its own files (4 shards, 2 copies). Its checkpoint resumes on a mesh of the same
  packing (mesh.data=4 x tensor=2: ZeRO-1 over 4 shards by the same table); a mesh of
  another (mesh.data=8) is refused in one line naming `mesh` before the checkpoint is
  touched. A resumed run writes no first generation of its own: the restore links
  the checkpoint's back."""
  from dos_jax.step import disk_tier  # pylint: disable=import-outside-toplevel
  out, state = str(tmp_path / 'run'), str(tmp_path / 'state')
  common = ['offload.disk_dir=' + state, 'offload.platform=gpu', 'offload.policy=stride']
  code, err = _train(dataset, out, capsys, *common, 'mesh.fsdp=4', 'train.steps=2')
  assert code == 0, err[-3000:]
  assert {n.split('.')[1] for n in os.listdir(state)} == {f's{i:03d}' for i in range(8)}
  ckpt = os.path.join(out, 'checkpoints', '2')
  before = integrity.read_manifest(ckpt)
  code, err = _train(dataset, out, capsys, *common, 'mesh.data=8', 'train.steps=3')
  lines = [line for line in err.splitlines() if 'shard-major over 4 devices' in line]
  assert code == 2 and len(lines) == 1, err[-3000:]
  assert lines[0].startswith('dos-jax: error: --set mesh.data=8: mesh: the checkpoint'), lines
  assert integrity.read_manifest(ckpt) == before

  def written(*args):
    raise AssertionError('a resumed run wrote a first generation')

  monkeypatch.setattr(disk_tier, 'write_initial', written)
  code, err = _train(dataset, out, capsys, *common, 'mesh.data=4', 'mesh.tensor=2',
                     'train.steps=3')
  assert code == 0 and f'resumed from {os.path.dirname(ckpt)} at step 2' in err, err[-3000:]



@pytest.mark.slow
def test_a_run_moves_its_state_to_disk_and_back_across_resumes_exactly(
    dataset, reference, tmp_path, capsys):
  """Steps 1-2 without a disk tier, 3-4 with one (the checkpoint of trees restored into
  files the run had not written), 5-8 without (the checkpoint of files restored into
  memory): the uninterrupted run's losses and eval loss, bit for bit."""
  out, disk = str(tmp_path / 'run'), 'offload.disk_dir=' + str(tmp_path / 'state')
  for steps, extra in ((EVERY, ()), (2 * EVERY, (disk,)), (None, ())):
    more = () if steps is None else (f'train.steps={steps}',)
    code, err = _train(dataset, out, capsys, *more, *extra)
    assert code == 0, err[-3000:]
  assert os.listdir(tmp_path / 'state')
  assert _outcome(out) == reference['outcome']
