"""Joining a multi-process run (several hosts, or several processes on one) through
`jax.distributed`, configured by environment variables.

A launcher starts the same `dos-jax train` command once per process, with:

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
from typing import Mapping

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


def settings(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
  """(coordinator, num_processes, process_id) from the environment, or None for a
  single-process run (no variable set, or JAX_NUM_PROCESSES=1).

  Raises:
    ConfigError: the variables are incomplete or inconsistent (names the variable).
  """
  env = os.environ if env is None else env
  if not any(name in env for name in (NUM_PROCESSES, PROCESS_ID)):
    return None
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
  touches a JAX backend."""
  found = settings(env)
  if found is None:
    return False
  coordinator, num, rank = found
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=rank)
  return True
