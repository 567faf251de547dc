"""The device mesh (`data`, `tensor`, `pipeline`, and `fsdp` when asked for) and
placement of params and batches.

Axes are sized from `MeshConfig`; their product must equal the number of devices the
run uses. Params are placed by the sharding table in `dos_jax.train.sharding`
(Megatron-style attention/MLP split over `tensor`, and over `fsdp` for ZeRO-3), batches
are split over `data` (x `fsdp`), and the optimizer state is sharded over `data` (or
`fsdp`) in host memory by dos_jax itself (`state_axis`).

The `fsdp` axis exists only when `mesh.fsdp` > 1, so runs without it keep the
three-axis mesh, specs and programs they had.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dos_jax.train import sharding
from dos_jax.train.config import MeshConfig
from dos_jax.train.configlib import ConfigError

AXES = sharding.MESH_AXES


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with the configured axis sizes.

  Raises:
    ConfigError: the sizes do not multiply to the device count (names the sizes).
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  fixed = cfg.fsdp * cfg.tensor * cfg.pipeline
  names = 'data*fsdp*tensor*pipeline' if cfg.fsdp > 1 else 'data*tensor*pipeline'
  data = cfg.data
  if data == -1:
    if n % fixed:
      raise ConfigError(
          f'mesh: {names.split("*", 1)[1]} = {fixed} does not divide the {n} available'
          ' device(s)'
      )
    data = n // fixed
  if data * fixed != n:
    sizes = [data, cfg.fsdp, cfg.tensor, cfg.pipeline] if cfg.fsdp > 1 else [
        data, cfg.tensor, cfg.pipeline]
    raise ConfigError(
        f'mesh: {names} = {"*".join(map(str, sizes))} = {data * fixed}'
        f' but {n} device(s) are available; set mesh.data to -1 or sizes that multiply to {n}'
    )
  # Mesh() (not jax.make_mesh) keeps Auto axes: jit propagates shardings from the
  # placed params instead of requiring explicit sharding types on every op.
  grid = np.asarray(devices, dtype=object)
  if cfg.fsdp > 1:
    return Mesh(grid.reshape(data, cfg.fsdp, cfg.tensor, cfg.pipeline), sharding.FSDP_MESH_AXES)
  return Mesh(grid.reshape(data, cfg.tensor, cfg.pipeline), AXES)


def has_fsdp(mesh: Mesh) -> bool:
  return sharding.FSDP in mesh.axis_names


def data_shards(mesh: Mesh) -> int:
  """How many ways the batch splits: data x fsdp."""
  return mesh.shape['data'] * (mesh.shape[sharding.FSDP] if has_fsdp(mesh) else 1)


def state_axis(mesh: Mesh) -> str:
  """The mesh axis dos_jax shards the optimizer state over: `data` (ZeRO-1), or with
  ZeRO-3 `fsdp`, as the params and gradients are (replicated over `data` beside it, as
  FSDP's hybrid sharding keeps it). One axis of the one mesh: JAX refuses a program
  whose shardings name different meshes."""
  return sharding.FSDP if has_fsdp(mesh) else 'data'


def state_shard_dims(mesh: Mesh) -> Any:
  """What the optimizer may pack its state by (`dos_jax.adamw`'s `shard_dims`, which the
  two-memory program packs by) where the state is split over several devices: each
  param's `fsdp` dimension in the sharding table, split over `fsdp` with ZeRO-3 and
  over `data` with ZeRO-1 (the params whole on each device, each device updating its
  own shards); None where the state axis has one device."""
  return sharding.fsdp_dims if mesh.shape[state_axis(mesh)] > 1 else None


def param_shardings(mesh: Mesh, params: Any) -> Any:
  """NamedSharding of every param leaf, from the model's sharding table (ZeRO-3 over
  `fsdp` when the mesh has it).

  Raises:
    ConfigError: a tensor dimension does not split over the mesh (names both).
  """
  fsdp = has_fsdp(mesh)
  rules = sharding.ShardingRules.megatron_fsdp() if fsdp else sharding.ShardingRules.megatron()
  try:
    return sharding.param_shardings(params, mesh, rules)
  except ValueError as err:
    raise ConfigError(f'{"mesh.fsdp/mesh.tensor" if fsdp else "mesh.tensor"}: {err}') from None


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Tokens [batch, seq+1] split over `data` (x `fsdp`), replicated over the others."""
  return NamedSharding(mesh, sharding.batch_spec(fsdp=has_fsdp(mesh)))


def check_divisible(mesh: Mesh, batch_size: int) -> None:
  """The global batch must split evenly over the data axes."""
  shards = data_shards(mesh)
  if batch_size % shards:
    axes = 'data x fsdp axes' if has_fsdp(mesh) else 'data axis'
    raise ConfigError(
        f'data.batch_size: {batch_size} is not divisible by the mesh {axes} ({shards})'
    )
