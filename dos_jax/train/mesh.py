"""The device mesh (`data`, `tensor`, `pipeline`) and placement of params and batches.

Axes are sized from `MeshConfig`; their product must equal the number of devices the
run uses. Params are placed by the sharding table in `dos_jax.train.sharding`
(Megatron-style attention/MLP split over `tensor`), batches are split over `data`, and
the optimizer state is sharded over `data` in host memory by dos_jax itself.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dos_jax.train import sharding
from dos_jax.train.config import MeshConfig
from dos_jax.train.configlib import ConfigError

AXES = ('data', 'tensor', 'pipeline')


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with the configured axis sizes.

  Raises:
    ConfigError: the sizes do not multiply to the device count (names the sizes).
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  fixed = cfg.tensor * cfg.pipeline
  data = cfg.data
  if data == -1:
    if n % fixed:
      raise ConfigError(
          f'mesh: tensor*pipeline = {fixed} does not divide the {n} available device(s)'
      )
    data = n // fixed
  if data * fixed != n:
    raise ConfigError(
        f'mesh: data*tensor*pipeline = {data}*{cfg.tensor}*{cfg.pipeline} = {data * fixed}'
        f' but {n} device(s) are available; set mesh.data to -1 or sizes that multiply to {n}'
    )
  # Mesh() (not jax.make_mesh) keeps Auto axes: jit propagates shardings from the
  # placed params instead of requiring explicit sharding types on every op.
  return Mesh(np.asarray(devices, dtype=object).reshape(data, cfg.tensor, cfg.pipeline), AXES)


def param_shardings(mesh: Mesh, params: Any) -> Any:
  """NamedSharding of every param leaf, from the model's sharding table.

  Raises:
    ConfigError: a tensor dimension does not split over `mesh.tensor` (names both).
  """
  try:
    return sharding.param_shardings(params, mesh, sharding.ShardingRules.megatron())
  except ValueError as err:
    raise ConfigError(f'mesh.tensor: {err}') from None


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Tokens [batch, seq+1] split over `data`, replicated over the other axes."""
  return NamedSharding(mesh, sharding.batch_spec())


def check_divisible(mesh: Mesh, batch_size: int) -> None:
  """The global batch must split evenly over the data axis."""
  data = mesh.shape['data']
  if batch_size % data:
    raise ConfigError(
        f'data.batch_size: {batch_size} is not divisible by the mesh data axis ({data})'
    )
