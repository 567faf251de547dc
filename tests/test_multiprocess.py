"""Two processes, one run: `dos-jax train` started twice on localhost, joined through
`jax.distributed` (gloo CPU collectives, one CPU device each), trains with data=2 (and
with ZeRO-3, fsdp=2) and matches a one-process run of the same mesh on 2 devices; the
checkpoint the two wrote jointly restores in one process.

The two-memory program under `offload.policy=auto`, each process given a different
calibrated profile through its profile cache: both take process 0's plan
(`dos_jax.train.agree`), process 1 says its own would have chosen another, and the run
(trained, checkpointed, resumed) matches one process running that plan.

Launched as clusters launch: Open MPI's `mpirun` (where installed: `.ci/run` installs
Debian's openmpi-bin) and SLURM's per-task variables, with none of the project's
variables set: `jax.distributed.initialize()` finds the run by itself.
"""

import dataclasses
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import dos_jax

from dos_jax.planner import hardware
from dos_jax.train import checkpoint, config, data, distributed, trainer
from dos_jax.train.configlib import ConfigError
from dos_jax.train.progress import read_metrics

STEPS = 4
SETS = [
    'model.n_layers=2', 'model.compute_dtype=float32', 'data.seq_len=32', 'data.batch_size=8',
    'optim.lr=3e-3', 'optim.warmup_steps=2', f'train.steps={STEPS}',
    'offload.policy=stride', 'train.log_every=1', 'train.eval_every=0', 'train.eval_batches=1',
    'checkpoint.every=0', 'checkpoint.async_save=false',
]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('tokens'))
  data.prepare(None, out, val_fraction=0.05, max_bytes=300_000, progress=False)
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _train_cmd(sets: list[str]) -> list[str]:
  cmd = [sys.executable, '-m', 'dos_jax.cli', 'train']
  for item in sets:
    cmd += ['--set', item]
  return cmd


def _bare_env(**extra: str) -> dict[str, str]:
  """This environment without JAX's, XLA's or the project's variables: one CPU device
  per process, and nothing that says there is a run to join."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_', 'XLA_', 'DOS_JAX_', 'SLURM_', 'OMPI_', 'PMIX_'))}
  return dict(env, **extra)


def _finish(procs: list[subprocess.Popen], timeout: float = 420) -> list[tuple[str, str]]:
  """Waits for every process (killing the rest when one hangs); asserts each exited 0."""
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  failed = [f'process {rank} exited {proc.returncode}: ...{err[-2000:]}'
            for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)) if proc.returncode]
  assert not failed, '\n'.join(failed)
  return outputs


def _start_two(sets: list[str], env: dict[str, str],
               per_rank: list[dict[str, str]] | None = None) -> list[tuple[str, str]]:
  """`dos-jax train` twice, joined through the project's three variables."""
  env = dict(env, JAX_NUM_PROCESSES='2', JAX_COORDINATOR_ADDRESS=f'localhost:{_free_port()}')
  per_rank = per_rank or [{}, {}]
  return _finish([subprocess.Popen(_train_cmd(sets), text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE,
                                   env=dict(env, JAX_PROCESS_ID=str(rank), **per_rank[rank]))
                  for rank in range(2)])


def _records(run_dir: str) -> list[dict]:
  return [r for r in read_metrics(os.path.join(run_dir, 'metrics.jsonl')) if 'loss' in r]


def _matches_one_process(sets: list[str], records: list[dict], run_dir: str, fsdp: bool,
                         plan_of=None) -> trainer.Trainer:
  """The run's logged losses, and the checkpoint it wrote jointly, against the same run
  in this process on 2 local devices (`plan_of(ref)`: the plan each step runs)."""
  cfg = config.load(None, sets)
  ref = trainer.build(cfg, devices=jax.devices()[:2])
  plan = None if plan_of is None else plan_of(ref)
  sampler = ref.train_sampler()
  for record in records:
    result = ref.step(next(sampler), plan=plan, split=True)
    np.testing.assert_allclose(record['loss'], result.loss, rtol=1e-6)
    np.testing.assert_allclose(record['grad_norm'], result.grad_norm, rtol=1e-5)

  # The jointly written checkpoint restores in one process, on one device.
  fresh = trainer.build(config.load(None, [*sets, 'mesh.data=1', 'mesh.fsdp=1']),
                        devices=jax.devices()[:1])
  loader = checkpoint.Checkpointer(os.path.join(run_dir, 'checkpoints'), keep=3,
                                   async_save=False)
  last = records[-1]['step']
  try:
    assert loader.latest_step() == last
    restored = loader.restore(last, params=fresh.params, opt_state=fresh.opt_state,
                              tx=fresh.tx)
  finally:
    loader.close()
  assert restored.meta['step'] == last
  # With fsdp the gradients are reduce-scattered, over gloo in the two processes and in
  # XLA:CPU here, in another order: a few elements differ in the last bits (seen: 1 of
  # 32768 by 6e-7 after 4 steps), hence the looser bound.
  tol = dict(rtol=1e-5, atol=1e-6) if fsdp else dict(rtol=1e-6, atol=1e-7)
  for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
  got_state = checkpoint.state_to_trees(restored.opt_state, restored.params)
  want_state = checkpoint.state_to_trees(ref.opt_state, ref.params)
  for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)
  return ref


def test_settings_come_from_the_environment():
  assert distributed.settings({}) is None
  assert distributed.settings({'JAX_NUM_PROCESSES': '1', 'JAX_PROCESS_ID': '0'}) is None
  env = {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1'}
  assert distributed.settings(env) == ('h:1', 2, 1)
  for bad, culprit in [({**env, 'JAX_PROCESS_ID': '2'}, 'JAX_PROCESS_ID=2'),
                       ({**env, 'JAX_NUM_PROCESSES': 'two'}, 'JAX_NUM_PROCESSES'),
                       ({'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0'},
                        'JAX_COORDINATOR_ADDRESS'),
                       ({'JAX_PROCESS_ID': '0'}, 'JAX_NUM_PROCESSES is not set')]:
    with pytest.raises(ConfigError, match=culprit):
      distributed.settings(bad)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
@pytest.mark.parametrize('mesh', [['mesh.data=2'], ['mesh.data=1', 'mesh.fsdp=2']],
                         ids=['data2', 'fsdp2'])
def test_two_processes_train_as_one_and_their_checkpoint_restores_in_one(dataset, tmp_path,
                                                                         mesh):
  run_dir = str(tmp_path / 'run')
  sets = [f'data.path={dataset}', *SETS, *mesh, f'train.out_dir={run_dir}']
  _start_two(sets, dict(os.environ, JAX_PLATFORMS='cpu',
                        XLA_FLAGS='--xla_force_host_platform_device_count=1'))
  # Both processes joined one run: each saw 2 devices, and only process 0 logged.
  records = _records(run_dir)
  assert [r['step'] for r in records] == list(range(1, STEPS + 1))
  _matches_one_process(sets, records, run_dir, fsdp='mesh.fsdp=2' in mesh)


# Two calibrated profiles that choose different plans for the run below (9 subgroups):
# a fast link beside a slow host streams 6 of them, a fast host takes them all.
_LINKS = hardware.H100_PCIE_GEN5_NODE
PROFILE_0 = dataclasses.replace(_LINKS, name='test-links', source='test',
                                host_adamw_gparams_by_threads={1: 0.05},
                                h2d_gbps=2.0, d2h_gbps=2.0, both_gbps=1.0)
PROFILE_1 = dataclasses.replace(PROFILE_0, name='test-host',
                                host_adamw_gparams_by_threads={1: 1.0},
                                h2d_gbps=1.0, d2h_gbps=1.0, both_gbps=0.5)
AUTO_SETS = [
    'model.n_layers=2', 'model.compute_dtype=float32', 'data.seq_len=32', 'data.batch_size=8',
    'optim.lr=3e-3', 'optim.warmup_steps=2', 'optim.schedule=constant',
    'offload.policy=auto', 'offload.platform=gpu', 'offload.subgroup_size=65536',
    'train.log_every=1', 'train.eval_every=0', 'checkpoint.every=0',
    'checkpoint.async_save=false',
]


def _profile_cache(root, profile) -> str:
  """A cache folder holding `profile` as this machine's calibrated CPU profile."""
  os.makedirs(root, exist_ok=True)
  profile.to_json(os.path.join(root, f'profile-{socket.gethostname()}-cpu.json'))
  return str(root)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
def test_auto_takes_process_0s_plan_from_different_profiles_and_resumes(
    dataset, tmp_path, monkeypatch):
  """Under fsdp=2 (ZeRO-3: each process's state is its own shard). The agreement on a
  plan is the same on any mesh; training as one on data=2 and fsdp=2 is
  `test_two_processes_train_as_one_and_their_checkpoint_restores_in_one`'s."""
  mesh = ['mesh.data=1', 'mesh.fsdp=2']
  caches = [_profile_cache(tmp_path / f'cache{rank}', profile)
            for rank, profile in enumerate((PROFILE_0, PROFILE_1))]
  run_dir = str(tmp_path / 'run')
  sets = [f'data.path={dataset}', *AUTO_SETS, *mesh, f'train.out_dir={run_dir}']
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=1')
  per_rank = [{'DOS_JAX_CACHE_DIR': cache} for cache in caches]
  # Two steps and a checkpoint, then two more from it: train, save, resume.
  first = _start_two([*sets, 'train.steps=2'], env, per_rank)
  second = _start_two([*sets, f'train.steps={STEPS}'], env, per_rank)
  records = _records(run_dir)
  assert [r['step'] for r in records] == list(range(1, STEPS + 1))

  # The plan process 0's profile gives, here from the same cache: every step ran it.
  monkeypatch.setenv('DOS_JAX_CACHE_DIR', caches[0])
  monkeypatch.delenv('XDG_CACHE_HOME', raising=False)

  def plan_of(ref):
    return ref.cfg.offload.placement.plan(ref.opt_state.layout.spec())

  ref = _matches_one_process([*sets, f'train.steps={STEPS}'], records, run_dir,
                             fsdp='mesh.fsdp=2' in mesh, plan_of=plan_of)
  spec = ref.opt_state.layout.spec()
  plans = [dos_jax.Auto(p).plan(spec) for p in (PROFILE_0, PROFILE_1)]
  assert plans[0] != plans[1] and plans[0].host and plans[0].streamed
  assert {r['offload/plan'] for r in records} == {plans[0].describe()}
  # Process 1 said, in each of the two runs, that its own profile chose otherwise.
  for (_, err0), (_, err1) in (first, second):
    said = [line for line in err1.splitlines() if line.startswith('dos-jax: process 1:')]
    assert said == [f'dos-jax: process 1: its own calibrated profile would have chosen'
                    f' {plans[1].describe()}; takes process 0\'s plan {plans[0].describe()}']
    assert 'dos-jax: process 0:' not in err0


def _srun_port() -> tuple[str, int]:
  """A SLURM job id whose coordinator port (JAX takes 61440 + id % 4096, above the
  kernel's ephemeral range) is free now."""
  for port in range(61440 + os.getpid() % 4096, 65536):
    with socket.socket() as s:
      try:
        s.bind(('localhost', port))
      except OSError:
        continue
    return str(4096 * 7 + port - 61440), port
  pytest.skip('no free port in 61440..65535 for the SLURM coordinator')


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
def test_two_srun_tasks_join_through_jaxs_slurm_detection(dataset, tmp_path):
  """The variables `srun --ntasks=2` sets for each task, and none of the project's."""
  run_dir = str(tmp_path / 'run')
  sets = [f'data.path={dataset}', *SETS, 'mesh.data=2', f'train.out_dir={run_dir}']
  job, _ = _srun_port()
  env = _bare_env(SLURM_JOB_ID=job, SLURM_STEP_NODELIST='localhost', SLURM_NTASKS='2',
                  SLURM_STEP_NUM_NODES='1')
  assert distributed.cluster(dict(env, SLURM_PROCID='0', SLURM_LOCALID='0')).name == 'SLURM'
  _finish([subprocess.Popen(_train_cmd(sets), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)))
           for rank in range(2)])
  records = _records(run_dir)
  assert [r['step'] for r in records] == list(range(1, STEPS + 1))
  _matches_one_process(sets, records, run_dir, fsdp=False)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
def test_mpirun_starts_two_processes_that_train_as_one(dataset, tmp_path):
  """`mpirun -np 2 dos-jax train ...` with nothing project-specific in the environment."""
  mpirun = shutil.which('mpirun')
  if mpirun is None:
    pytest.skip('mpirun not found (.ci/run installs Debian\'s openmpi-bin where apt works)')
  run_dir = str(tmp_path / 'run')
  sets = [f'data.path={dataset}', *SETS, 'mesh.data=2', f'train.out_dir={run_dir}']
  dos_jax_cmd = shutil.which('dos-jax')
  cmd = [dos_jax_cmd, 'train'] if dos_jax_cmd else _train_cmd([])
  for item in sets:
    cmd += ['--set', item]
  root = ['--allow-run-as-root'] if os.geteuid() == 0 else []
  _finish([subprocess.Popen([mpirun, *root, '--oversubscribe', '-np', '2', *cmd], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_bare_env())])
  records = _records(run_dir)
  assert [r['step'] for r in records] == list(range(1, STEPS + 1))
  _matches_one_process(sets, records, run_dir, fsdp=False)


def test_cluster_launchers_are_recognized_from_their_variables():
  slurm = {'SLURM_JOB_ID': '12', 'SLURM_STEP_NODELIST': 'node[01-02]', 'SLURM_NTASKS': '8',
           'SLURM_PROCID': '5', 'SLURM_LOCALID': '1'}
  assert distributed.cluster(slurm) == ('SLURM', 8, 5)
  assert distributed.settings(slurm) == (None, 8, 5)
  # sbatch alone (the batch script, before srun) sets no SLURM_PROCID: not a task.
  assert distributed.cluster({k: v for k, v in slurm.items() if k != 'SLURM_PROCID'}) is None
  assert distributed.cluster({**slurm, 'SLURM_NTASKS': '1'}) is None
  ompi = {'OMPI_MCA_orte_hnp_uri': '1531576320.0;tcp://10.96.0.1:34911',
          'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '1'}
  assert distributed.cluster(ompi) == ('Open MPI', 2, 1)
  k8s = {'KUBERNETES_SERVICE_HOST': '10.0.0.1', 'JOB_COMPLETION_INDEX': '3'}
  assert distributed.cluster(k8s) == ('Kubernetes', None, 3)
  assert distributed.settings(k8s) == (None, 1, 3)
  # The project's variables win over a launcher's.
  manual = {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0'}
  assert distributed.settings({**slurm, **manual}) == ('h:1', 2, 0)
  assert distributed.cluster({}) is None and distributed.settings({}) is None
