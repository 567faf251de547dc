"""Joining a multi-process run (several hosts, or several processes on one) through
`jax.distributed`, configured by environment variables.

Two routes, the first that applies:

* manual: the project's three variables (below), set by hand or by a script;
* a cluster launcher: under `srun` (SLURM), `mpirun` (Open MPI) or an indexed
  Kubernetes Job, `jax.distributed.initialize()` with no arguments finds the
  coordinator, the process count and this process's rank in the launcher's own
  variables (`cluster`, which reads them here only to know that there is a run to join
  and how many processes it has, for the pinned pool). `JAX_COORDINATOR_PORT`
  overrides the port JAX derives from the job id.

The manual route: a launcher starts the same `dos-jax train` command once per process,
with:

  JAX_COORDINATOR_ADDRESS  host:port of process 0's coordinator (read by JAX itself)
  JAX_NUM_PROCESSES        how many processes take part
  JAX_PROCESS_ID           this process's rank, 0 .. JAX_NUM_PROCESSES-1

Environment variables, not config keys, because they differ per process while the
config file is the one every process reads. After `initialize`, `jax.devices()` lists
every process's devices, the mesh spans them all, and every process feeds the same
global batch (each keeps only the rows of its own devices); orbax writes one checkpoint
jointly. On CPU the processes talk through gloo collectives.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import jax

from dos_jax.train.configlib import ConfigError

COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
NUM_PROCESSES = 'JAX_NUM_PROCESSES'
PROCESS_ID = 'JAX_PROCESS_ID'


def _int_var(env: Mapping[str, str], name: str) -> int:
  value = env.get(name)
  if value is None:
    raise ConfigError(f'{name} is not set; a multi-process run needs {COORDINATOR},'
                      f' {NUM_PROCESSES} and {PROCESS_ID}')
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f'{name}={value!r}: expected an integer') from None


class Cluster(NamedTuple):
  """A cluster launcher's run, as its environment describes it."""

  name: str  # 'SLURM', 'Open MPI' or 'Kubernetes'
  num_processes: int | None  # None: JAX asks the cluster (Kubernetes)
  process_id: int | None


# What `jax.distributed.initialize()`'s detection looks for (jax/_src/clusters): all of
# these variables for SLURM (srun sets them per task; sbatch alone sets no SLURM_PROCID),
# the launcher's URI for Open MPI (mpirun / mpiexec), the service host for Kubernetes.
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID',
          'SLURM_LOCALID')
_OMPI = 'OMPI_MCA_orte_hnp_uri'


def cluster(env: Mapping[str, str] | None = None) -> Cluster | None:
  """The cluster launcher this process runs under, or None (none, or one process)."""
  env = os.environ if env is None else env
  found = None
  if all(name in env for name in _SLURM):
    found = Cluster('SLURM', int(env['SLURM_NTASKS']), int(env['SLURM_PROCID']))
  elif _OMPI in env and 'OMPI_COMM_WORLD_SIZE' in env:
    found = Cluster('Open MPI', int(env['OMPI_COMM_WORLD_SIZE']),
                    int(env.get('OMPI_COMM_WORLD_RANK', 0)))
  elif 'KUBERNETES_SERVICE_HOST' in env and 'JOB_COMPLETION_INDEX' in env:
    found = Cluster('Kubernetes', None, int(env['JOB_COMPLETION_INDEX']))
  if found is None or found.num_processes == 1:
    return None
  return found


def settings(env: Mapping[str, str] | None = None
             ) -> tuple[str | None, int, int | None] | None:
  """(coordinator, num_processes, process_id) from the environment, or None for a
  single-process run (no variable set, or JAX_NUM_PROCESSES=1). The project's
  variables first; else a cluster launcher's run (`cluster`): coordinator None, which
  JAX finds itself.

  Raises:
    ConfigError: the variables are incomplete or inconsistent (names the variable).
  """
  env = os.environ if env is None else env
  if not any(name in env for name in (NUM_PROCESSES, PROCESS_ID)):
    found = cluster(env)
    if found is None:
      return None
    # Kubernetes keeps the count in the Job, not the environment: 1 sizes the pinned
    # pool for the whole state (an upper bound); JAX finds the real count.
    return None, found.num_processes or 1, found.process_id
  num = _int_var(env, NUM_PROCESSES)
  rank = _int_var(env, PROCESS_ID)
  if num < 1:
    raise ConfigError(f'{NUM_PROCESSES}={num}: expected a positive integer')
  if not 0 <= rank < num:
    raise ConfigError(f'{PROCESS_ID}={rank}: expected 0 .. {num - 1} ({NUM_PROCESSES}={num})')
  if num == 1:
    return None
  coordinator = env.get(COORDINATOR)
  if not coordinator:
    raise ConfigError(f'{COORDINATOR} is not set; process 0 listens there (host:port)')
  return coordinator, num, rank


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
  """Calls `jax.distributed.initialize` when the environment asks for a multi-process
  run (CPU collectives through gloo); returns whether it did. Must run before anything
  touches a JAX backend. Under a cluster launcher, with no arguments: JAX's own
  detection reads the launcher's variables."""
  found = settings(env)
  if found is None:
    return False
  coordinator, num, rank = found
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if coordinator is None:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                               process_id=rank)
  return True
