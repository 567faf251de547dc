"""Two processes, one run, the optimizer state partly on disk (`offload.disk_dir`, with
`offload.host_state_gib` keeping some subgroups in memory): `dos-jax train` started
twice on localhost, joined through `jax.distributed` (one CPU device each), each
process given a disk folder of its own, as a node's local disk would be.

Each process writes only its own device's files (its data shard's columns), the first
generation from its own shards of the params, and checkpoints them into the folder the
two share; a run stopped after a step past a checkpoint (its newest checkpoint gone, as
when killed before saving it) resumes from that checkpoint in two processes, and the
whole run matches one process running the same mesh on 2 devices with the whole state
in memory (bit for bit on data=2), the checkpoint too.
"""

import os
import shutil
import subprocess
import types

import jax
import numpy as np
import pytest

from dos_jax.kernels import host_adamw_disk
from dos_jax.train import checkpoint, config, trainer
from dos_jax.train.configlib import ConfigError
from dos_jax.train.progress import read_metrics
from tests.test_multiprocess import _finish
from tests.test_multiprocess import _free_port
from tests.test_multiprocess import _train_cmd
from tests.test_multiprocess import dataset  # pylint: disable=unused-import  (the fixture)

pytestmark = pytest.mark.skipif(not host_adamw_disk.disk_kernel_available(),
                                reason='the native disk kernel is not built')

SETS = [
    'model.n_layers=2', 'model.compute_dtype=float32', 'data.seq_len=32', 'data.batch_size=8',
    'optim.lr=3e-3', 'optim.warmup_steps=2', 'offload.policy=stride',
    'offload.subgroup_size=65536', 'train.log_every=1', 'train.eval_every=0',
    'train.eval_batches=1', 'checkpoint.every=2', 'checkpoint.async_save=false',
]
# Two subgroups' state in host memory (of 9), the others on disk.
DISK_CAP = 'offload.host_state_gib=0.001'


def _start_two(sets: list[str], states: list[str] | None) -> None:
  """`dos-jax train` twice, joined, process i keeping its disk tier in `states[i]`
  (None: no disk tier)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_NUM_PROCESSES='2',
             XLA_FLAGS='--xla_force_host_platform_device_count=1',
             JAX_COORDINATOR_ADDRESS=f'localhost:{_free_port()}')
  disk = lambda rank: [] if states is None else [DISK_CAP, f'offload.disk_dir={states[rank]}']
  _finish([subprocess.Popen(_train_cmd([*sets, *disk(rank)]),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env, JAX_PROCESS_ID=str(rank)))
           for rank in range(2)])


def _losses(run_dir: str) -> dict[int, tuple[float, float]]:
  """Each step's logged loss and gradient norm (the latest run's, after a resume)."""
  return {r['step']: (r['loss'], r['grad_norm'])
          for r in read_metrics(os.path.join(run_dir, 'metrics.jsonl')) if 'loss' in r}


def _file_indices(folder: str) -> set[str]:
  """The file indices (`s<i>`: the device's) of the disk tier's files in `folder`."""
  return {name.split('.')[1] for name in os.listdir(folder) if name.startswith('sg')}


@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
@pytest.mark.parametrize('mesh', [
    ['mesh.data=2'],
    # ZeRO-3 in the two-memory program (on the CPU backend), which packs each device's
    # state from its own shards of the params.
    pytest.param(['mesh.data=1', 'mesh.fsdp=2', 'offload.platform=gpu'],
                 marks=pytest.mark.slow),
], ids=['data2', 'fsdp2'])
def test_two_processes_keep_their_own_files_and_resume_as_one_in_memory(
    dataset, tmp_path, mesh):
  run_dir, states = str(tmp_path / 'run'), [str(tmp_path / f'state{i}') for i in range(2)]
  sets = [f'data.path={dataset}', *SETS, *mesh, f'train.out_dir={run_dir}']
  _start_two([*sets, 'train.steps=3'], states)
  # Each process wrote and updated its own device's files only.
  assert [_file_indices(state) for state in states] == [{'s000'}, {'s001'}]
  ckpts = os.path.join(run_dir, 'checkpoints')
  files = os.path.join(ckpts, '2', checkpoint.SUBGROUPS, '0')
  assert _file_indices(files) == {'s000', 's001'}  # both processes' shards, disk and memory
  first = _losses(run_dir)
  shutil.rmtree(os.path.join(ckpts, '3'))  # stopped after step 3, before its checkpoint
  _start_two([*sets, 'train.steps=4'], states)
  resumed = _losses(run_dir)
  assert sorted(resumed) == [1, 2, 3, 4] and resumed[3] == first[3]

  # The same run in this process on 2 devices, the whole state in memory. With fsdp the
  # gradients are reduce-scattered over gloo in the two processes and in XLA:CPU here,
  # in another order: a few elements differ in the last bits (as in tests/
  # test_multiprocess.py, seen: the gradient norm by 7e-8 at step 4); on data=2 no bit.
  tol = dict(rtol=1e-5, atol=1e-6) if 'mesh.fsdp=2' in mesh else dict(rtol=0, atol=0)
  cfg = config.load(None, [*sets, 'train.steps=4'])
  ref = trainer.build(cfg, devices=jax.devices()[:2])
  sampler = ref.train_sampler()
  for step in range(1, 5):
    result = ref.step(next(sampler), split=True)
    np.testing.assert_allclose(resumed[step], (result.loss, result.grad_norm), **tol)
  fresh = trainer.build(cfg, devices=jax.devices()[:2])
  loader = checkpoint.Checkpointer(ckpts, keep=3, async_save=False)
  try:
    restored = loader.restore(4, params=fresh.params, opt_state=fresh.opt_state, tx=fresh.tx)
  finally:
    loader.close()
  got = checkpoint.state_to_trees(restored.opt_state, restored.params)
  want = checkpoint.state_to_trees(ref.opt_state, ref.params)
  for a, b in zip(jax.tree.leaves((restored.params, got)), jax.tree.leaves((ref.params, want)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
def test_a_checkpoint_without_a_disk_tier_resumes_onto_disk_in_two_processes(dataset, tmp_path):
  """Steps 1-2 in two processes with the state in memory, 3-4 resumed with a disk tier:
  each process writes its own device's files from the restored checkpoint (packed split
  over the processes, nothing gathered), and the run matches one process on 2 devices
  with the state in memory, bit for bit."""
  run_dir, states = str(tmp_path / 'run'), [str(tmp_path / f'state{i}') for i in range(2)]
  sets = [f'data.path={dataset}', *SETS, 'mesh.data=2', f'train.out_dir={run_dir}']
  _start_two([*sets, 'train.steps=2'], None)
  _start_two([*sets, 'train.steps=4'], states)
  assert [_file_indices(state) for state in states] == [{'s000'}, {'s001'}]
  resumed = _losses(run_dir)
  ref = trainer.build(config.load(None, [*sets, 'train.steps=4']), devices=jax.devices()[:2])
  sampler = ref.train_sampler()
  for step in range(1, 5):
    result = ref.step(next(sampler), split=True)
    np.testing.assert_array_equal(resumed[step], (result.loss, result.grad_norm), f'step {step}')


def test_what_a_process_cannot_write_from_its_own_shards_is_refused_in_one_line(monkeypatch):
  """Each process writes the first generation from its own shards of the params: the
  `tensor` shards of its devices' params must be its own, and ZeRO-3's state packed by
  the params' shards (the two-memory program's; the one-memory program packs it leaf
  after leaf, each device's columns across other devices' shards)."""
  from dos_jax.train import agree  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(agree, 'processes', lambda: 2)
  device = lambda rank: types.SimpleNamespace(process_index=rank)

  def mesh(owners, axes=('data', 'tensor')):  # each device's process
    return types.SimpleNamespace(shape=dict(zip(axes, owners.shape)), axis_names=axes,
                                 devices=np.vectorize(device, otypes=[object])(owners))

  def refused(sets, grid):
    with pytest.raises(ConfigError) as err:
      trainer._check_disk_processes(config.load(None, ['offload.disk_dir=/x', *sets]), grid)
    assert '\n' not in str(err.value)
    return str(err.value)

  cfg = config.load(None, ['offload.disk_dir=/x'])
  trainer._check_disk_processes(cfg, mesh(np.array([[0, 0], [1, 1]])))  # tensor within
  assert refused([], mesh(np.array([[0, 1], [0, 1]]))).startswith(
      'offload.disk_dir: a run of 2 processes keeps its optimizer state on disk only where '
      'each process holds every mesh.tensor shard')
  fsdp = mesh(np.array([[[0]], [[1]]]).reshape(1, 2, 1), ('data', 'fsdp', 'tensor'))
  trainer._check_disk_processes(config.load(None, ['offload.disk_dir=/x', 'mesh.fsdp=2',
                                                   'offload.platform=gpu']), fsdp)
  assert refused(['mesh.fsdp=2', 'offload.platform=cpu'], fsdp).startswith(
      'offload.disk_dir: a ZeRO-3 run (mesh.fsdp=2) of 2 processes keeps its optimizer '
      'state on disk only in the two-memory program')
