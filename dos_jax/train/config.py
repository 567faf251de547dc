"""The run config: typed, frozen, validated sections read from YAML.

`dos-jax train CONFIG --set optim.lr=1e-3` reads CONFIG (default: the packaged tiny
run), applies the overrides and builds a `RunConfig`. Every default lives in the
dataclasses below (or in `ModelConfig` / `DataConfig` next to the code they drive);
the YAML files in `configs/` only override. Strings from YAML (the placement policy,
the schedule) are parsed here, once, into values the rest of the runner uses.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
from typing import Literal, Sequence

import dos_jax
from dos_jax.policies import Policy
from dos_jax.train.configlib import (
    NON_NEGATIVE,
    OPEN_UNIT_INTERVAL,
    POSITIVE,
    UNIT_INTERVAL,
    ConfigError,
    apply_overrides,
    field,
    from_dict,
    read_yaml,
)
from dos_jax.train.data import DataConfig
from dos_jax.train.model import ModelConfig

DEFAULT_CONFIG = 'tiny.yaml'
"""The packaged config `dos-jax train` runs when given none (same text as configs/tiny.yaml)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW hyper-parameters and the learning-rate schedule.

  Attributes:
    lr: peak learning rate, reached at the end of warmup.
    schedule: 'cosine' (linear warmup, then cosine decay to `min_lr_ratio * lr` at
      the last step) or 'constant' (linear warmup, then flat).
    warmup_steps: steps of linear warmup from 0.
    min_lr_ratio: final learning rate of the cosine, as a fraction of `lr`.
    b1: AdamW first-moment decay.
    b2: AdamW second-moment decay.
    eps: AdamW epsilon (outside the square root, as in optax).
    weight_decay: decoupled weight decay, applied to matrices only (not norms).
    clip_norm: clip gradients to this global L2 norm; null disables clipping (the
      norm is still computed and reported).
    mu_dtype: dtype of the first moment in host memory; bfloat16 halves it.
  """

  lr: float = field(3e-4, check=POSITIVE)
  schedule: Literal['cosine', 'constant'] = 'cosine'
  warmup_steps: int = field(100, check=NON_NEGATIVE)
  min_lr_ratio: float = field(0.1, check=UNIT_INTERVAL)
  b1: float = field(0.9, check=OPEN_UNIT_INTERVAL)
  b2: float = field(0.95, check=OPEN_UNIT_INTERVAL)
  eps: float = field(1e-8, check=POSITIVE)
  weight_decay: float = field(0.1, check=NON_NEGATIVE)
  clip_norm: float | None = field(1.0, check=POSITIVE)
  mu_dtype: Literal['float32', 'bfloat16'] | None = None


PolicyName = Literal['all_host', 'all_device', 'stride', 'device_fraction', 'auto']


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """Where the optimizer state lives and which subgroups are updated where.

  Attributes:
    policy: 'all_host' (every subgroup updated on the host: ZeRO-Offload),
      'all_device' (state resident in device memory: no offload), 'stride' (every
      `stride`-th subgroup streamed to the device: the paper's method),
      'device_fraction' (a `fraction` of the subgroups on the device) or 'auto'
      (the cost model chooses).
    stride: k of the 'stride' policy.
    fraction: f of the 'device_fraction' policy.
    subgroup_size: elements per packed state subgroup; null takes dos_jax's default.
    placement: the policy value `policy` names (derived, not read from YAML).
  """

  policy: PolicyName = 'all_host'
  stride: int = field(2, check=POSITIVE)
  fraction: float = field(0.5, check=UNIT_INTERVAL)
  subgroup_size: int | None = field(None, check=POSITIVE)
  placement: Policy = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, 'placement', _placement(self))


def _placement(cfg: OffloadConfig) -> Policy:
  if cfg.policy == 'all_host':
    return dos_jax.AllHost()
  if cfg.policy == 'all_device':
    return dos_jax.AllDevice()
  if cfg.policy == 'stride':
    return dos_jax.Stride(cfg.stride)
  if cfg.policy == 'device_fraction':
    return dos_jax.DeviceFraction(cfg.fraction)
  # Calibrates this machine on first use (cached); see dos_jax.Auto.
  return dos_jax.Auto()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axes; their product must equal the number of devices used.

  Attributes:
    data: data-parallel size (batch split, optimizer state sharded ZeRO-1 style);
      -1 takes every device the other axes leave.
    tensor: tensor-parallel size (Megatron-style split of attention and MLP).
    pipeline: pipeline stages; only 1 is supported until pipeline execution lands.
  """

  data: int = -1
  tensor: int = field(1, check=POSITIVE)
  pipeline: int = field(1, check=POSITIVE)

  def __post_init__(self):
    if self.data != -1 and self.data < 1:
      raise ValueError(f'data: expected a positive integer or -1 (all devices), got {self.data}')
    if self.pipeline > 1:
      raise ValueError(
          f'pipeline: pipeline parallelism is not supported yet (got {self.pipeline}); use 1'
      )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints of params, optimizer state, step and data position.

  Attributes:
    dir: checkpoint directory; null means `<train.out_dir>/checkpoints`. A run whose
      directory holds checkpoints resumes from the newest.
    every: save every this many steps (0: only at the end and on Ctrl-C).
    keep: how many of the newest checkpoints to keep.
    async_save: write in a background thread while training continues.
  """

  dir: str | None = None
  every: int = field(500, check=NON_NEGATIVE)
  keep: int = field(3, check=POSITIVE)
  async_save: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The loop: how long, how often to evaluate and log, where outputs go.

  Attributes:
    steps: optimizer steps in total (a resumed run stops at the same step).
    seed: seeds parameter initialization (data sampling has its own `data.seed`).
    eval_every: evaluate on the validation split every this many steps (0: never,
      except once at the end).
    eval_batches: validation batches per evaluation.
    log_every: write a metrics line (and refresh a non-terminal progress line)
      every this many steps.
    out_dir: run directory: resolved config, metrics, checkpoints.
    metrics_file: JSON-lines metrics file name inside `out_dir`.
    split_every: which steps run as two programs (gradients, then update) so that the
      update phase is timed; the others run as one program, the faster form. null:
      the steps whose metrics are logged; N: every N-th step; 0: none; 1: every step
      (the two-program runner). An adaptive policy (auto) also gets a split step
      whenever it asks for a measurement.
  """

  steps: int = field(1000, check=POSITIVE)
  seed: int = field(0, check=NON_NEGATIVE)
  eval_every: int = field(200, check=NON_NEGATIVE)
  eval_batches: int = field(8, check=POSITIVE)
  log_every: int = field(10, check=POSITIVE)
  out_dir: str = 'runs/default'
  metrics_file: str = 'metrics.jsonl'
  split_every: int | None = field(None, check=NON_NEGATIVE)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything `dos-jax train` needs; each section documents its fields."""

  model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(preset='tiny'))
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def __post_init__(self):
    if self.data.seq_len > self.model.max_seq_len:
      raise ValueError(
          f'data.seq_len: {self.data.seq_len} exceeds model.max_seq_len'
          f' ({self.model.max_seq_len})'
      )
    if self.mesh.data > 0 and self.data.batch_size % self.mesh.data:
      raise ValueError(
          f'data.batch_size: {self.data.batch_size} is not divisible by mesh.data'
          f' ({self.mesh.data})'
      )

  @property
  def checkpoint_dir(self) -> str:
    return self.checkpoint.dir or os.path.join(self.train.out_dir, 'checkpoints')

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.train.out_dir, self.train.metrics_file)


def default_config_text() -> str:
  """The packaged default config (the tiny CPU run), readable from any directory."""
  return (
      importlib.resources.files('dos_jax.train').joinpath('configs', DEFAULT_CONFIG)
      .read_text(encoding='utf-8')
  )


def load(path: str | None = None, overrides: Sequence[str] = ()) -> RunConfig:
  """Reads a YAML run config, applies `KEY=VALUE` overrides and validates it.

  Raises:
    ConfigError: one line naming the file and the offending key.
  """
  if path is None:
    source, text = f'<packaged {DEFAULT_CONFIG}>', default_config_text()
  else:
    source = path
    try:
      with open(path, encoding='utf-8') as f:
        text = f.read()
    except FileNotFoundError:
      raise ConfigError(f'{path}: no such config file') from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
      raise ConfigError(f'{path}: cannot read ({type(err).__name__})') from None
  try:
    data = apply_overrides(read_yaml(text, source), overrides)
    return from_dict(RunConfig, data)
  except ConfigError as err:
    message = str(err)
    raise ConfigError(message if message.startswith(source) else f'{source}: {message}') from None
