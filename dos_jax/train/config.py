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
import re
from typing import Literal, Sequence

import dos_jax
from dos_jax import Policy
from dos_jax.train.configlib import (
    NON_EMPTY,
    NON_NEGATIVE,
    OPEN_UNIT_INTERVAL,
    POSITIVE,
    UNIT_INTERVAL,
    ConfigError,
    apply_overrides,
    field,
    from_dict,
    parse_override,
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


PolicyName = Literal['all_host', 'all_device', 'stride', 'device_fraction', 'auto', 'none']


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  """Where the optimizer state lives and which subgroups are updated where.

  Attributes:
    policy: 'all_host' (every subgroup updated on the host: ZeRO-Offload),
      'all_device' (state resident in device memory: no offload), 'stride' (every
      `stride`-th subgroup streamed to the device: the paper's method),
      'device_fraction' (a `fraction` of the subgroups on the device), 'auto'
      (the cost model chooses) or 'none' (plain `optax.adamw` after the step's
      global-norm clip, i.e. `optax.chain(clip_by_global_norm, adamw)`, with the same
      schedule, mask and dtypes and its state in device memory: the baseline).
    stride: k of the 'stride' policy.
    fraction: f of the 'device_fraction' policy.
    subgroup_size: elements per packed state subgroup; null takes dos_jax's default.
    keep_freed_host_memory: keep freed host memory in the process for the next step's
      buffers instead of faulting in and zeroing fresh pages every step (glibc only;
      see dos_jax.host_memory).
    platform: which program the optimizer builds: null (the backend's: the
      two-memory program on a GPU, the one-memory program on the CPU), 'gpu' (the
      two-memory program anywhere; on the CPU backend it runs with Pallas interpreted,
      how the tests check it) or 'cpu' (dos_jax.Implementation.program). With the state
      split over several devices, the two-memory program packs it by each device's
      shards of the params (the sharding table's fsdp dimension), so that each device
      runs the one construction on its own columns (docs/design.md).
    disk_dir: the disk tier's directory (dos_jax.Disk): host-updated subgroups beyond
      `host_state_gib` keep their state in files there (local NVMe for speed). null:
      no disk tier.
    host_state_gib: host memory the host tier's state may take before subgroups go to
      `disk_dir` (GiB); null: every host subgroup on disk. Needs `disk_dir`.
    placement: the policy value `policy` names, None for 'none' (derived, not read
      from YAML).
  """

  policy: PolicyName = 'all_host'
  stride: int = field(2, check=POSITIVE)
  fraction: float = field(0.5, check=UNIT_INTERVAL)
  subgroup_size: int | None = field(None, check=POSITIVE)
  keep_freed_host_memory: bool = True
  platform: Literal['cpu', 'gpu'] | None = None
  disk_dir: str | None = None
  host_state_gib: float | None = field(None, check=NON_NEGATIVE)
  placement: Policy | None = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    if self.host_state_gib is not None and self.disk_dir is None:
      raise ConfigError('offload.host_state_gib: caps the host memory of the state '
                        'before it goes to disk; set offload.disk_dir too')
    object.__setattr__(self, 'placement', _placement(self))


def _placement(cfg: OffloadConfig) -> Policy | None:
  if cfg.policy == 'none':
    return None
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
    fsdp: fully sharded data-parallel size (ZeRO-3, MaxText's `fsdp`): params, their
      gradients and the optimizer state split over it (and replicated over `data`
      beside it), the batch over data x fsdp; XLA gathers each matrix where it is
      used. Not combined with `pipeline`.
    tensor: tensor-parallel size (Megatron-style split of attention and MLP).
    pipeline: pipeline stages (GPipe, `train.microbatches` per batch); the model's
      layers split evenly over them (dos_jax/train/pipeline.py).
  """

  data: int = -1
  fsdp: int = field(1, check=POSITIVE)
  tensor: int = field(1, check=POSITIVE)
  pipeline: int = field(1, check=POSITIVE)

  def __post_init__(self):
    if self.data != -1 and self.data < 1:
      raise ValueError(f'data: expected a positive integer or -1 (all devices), got {self.data}')
    if self.fsdp > 1 and self.pipeline > 1:
      raise ValueError(
          f'fsdp: {self.fsdp} with mesh.pipeline = {self.pipeline} is not supported (a'
          ' pipelined run shards each stage over data and tensor only); set one of them to 1')


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

  dir: str | None = field(None, check=NON_EMPTY)
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
    microbatches: microbatches per batch in a pipelined run (mesh.pipeline > 1): the
      GPipe bubble is (pipeline-1)/(microbatches+pipeline-1); must be 1 otherwise.
    compilation_cache: keep the run's compiled programs in JAX's persistent compilation
      cache, `<dos_jax cache>/jax` (`dos_jax.train.compile_cache`), so that a resumed or
      repeated run loads them instead of compiling them; a cache set up for JAX
      (`JAX_COMPILATION_CACHE_DIR`) is used as it is.
  """

  steps: int = field(1000, check=POSITIVE)
  seed: int = field(0, check=NON_NEGATIVE)
  eval_every: int = field(200, check=NON_NEGATIVE)
  eval_batches: int = field(8, check=POSITIVE)
  log_every: int = field(10, check=POSITIVE)
  out_dir: str = field('runs/default', check=NON_EMPTY)
  metrics_file: str = field('metrics.jsonl', check=NON_EMPTY)
  split_every: int | None = field(None, check=NON_NEGATIVE)
  microbatches: int = field(1, check=POSITIVE)
  compilation_cache: bool = True

  def __post_init__(self):
    name = os.path.normpath(self.metrics_file)
    if os.path.isabs(self.metrics_file) or name == '.' or name.split(os.sep)[0] == '..':
      raise ValueError(
          f'metrics_file: must be a file name inside train.out_dir, got {self.metrics_file!r}'
      )


TrackerName = Literal['jsonl', 'tensorboard', 'wandb']


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """The Weights & Biases run of the `wandb` tracker (`WANDB_MODE=offline` logs with no
  network; `wandb sync` uploads later).

  Attributes:
    project: the W&B project.
    name: the run's display name; null: the run folder's name.
    tags: the run's tags.
  """

  project: str = field('dos_jax', check=NON_EMPTY)
  name: str | None = field(None, check=NON_EMPTY)
  tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrackConfig:
  """Where a run's metrics go, and which steps a profiler trace records.

  Attributes:
    trackers: where each metrics record goes, any of 'jsonl' (`train.metrics_file`),
      'tensorboard' (event files in `<train.out_dir>/tensorboard`, the `tensorboard`
      extra) and 'wandb' (a W&B run, the `wandb` extra); each gets every scalar at the
      same step, and the resolved config as hyperparameters.
    wandb: the W&B run of the 'wandb' tracker.
    profile_steps: [first, last]: a `jax.profiler` trace of steps first..last (step
      numbers as in the metrics, both traced) into `<train.out_dir>/profile`; those
      steps are left out of the run's step times. null: no trace.
  """

  trackers: tuple[TrackerName, ...] = ('jsonl',)
  wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
  profile_steps: tuple[int, ...] | None = None

  def __post_init__(self):
    if not self.trackers:
      raise ValueError("trackers: expected at least one of 'jsonl', 'tensorboard', 'wandb'")
    twice = [t for i, t in enumerate(self.trackers) if t in self.trackers[:i]]
    if twice:
      raise ValueError(f'trackers: {twice[0]!r} is given twice')
    steps = self.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
      raise ValueError(f'profile_steps: expected [first, last] with 1 <= first <= last,'
                       f' got {list(steps)}')

  @property
  def profiled(self) -> range:
    """The step numbers traced (empty without `profile_steps`)."""
    if self.profile_steps is None:
      return range(0)
    return range(self.profile_steps[0], self.profile_steps[1] + 1)


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
  track: TrackConfig = dataclasses.field(default_factory=TrackConfig)

  def __post_init__(self):
    if self.data.seq_len > self.model.max_seq_len:
      raise ValueError(
          f'data.seq_len: {self.data.seq_len} exceeds model.max_seq_len'
          f' ({self.model.max_seq_len})'
      )
    if self.mesh.data > 0 and self.data.batch_size % (self.mesh.data * self.mesh.fsdp):
      over = (f'mesh.data x mesh.fsdp ({self.mesh.data} x {self.mesh.fsdp})'
              if self.mesh.fsdp > 1 else f'mesh.data ({self.mesh.data})')
      raise ValueError(f'data.batch_size: {self.data.batch_size} is not divisible by {over}')
    if self.mesh.pipeline > 1 and self.model.shape().tie_embeddings:
      raise ValueError('model.tie_embeddings: a pipelined run (mesh.pipeline > 1) needs an'
                       ' untied output head on its last stage')
    if self.mesh.pipeline > 1 and self.model.from_hf is not None:
      raise ValueError('model.from_hf: a pipelined run (mesh.pipeline > 1) cannot start from'
                       ' a Hugging Face checkpoint yet')
    if self.train.microbatches > 1 and self.mesh.pipeline == 1:
      raise ValueError(
          f'train.microbatches: {self.train.microbatches} needs mesh.pipeline > 1'
          ' (microbatches feed pipeline stages; there is no gradient accumulation)'
      )

    if self.track.profile_steps is not None and self.track.profile_steps[0] > self.train.steps:
      raise ValueError(
          f'track.profile_steps: first step {self.track.profile_steps[0]} is past'
          f' train.steps ({self.train.steps}); nothing would be traced')

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
    ConfigError: one line naming the culprit: the `--set` argument that gave the key,
      else the file.
  """
  for text in overrides:  # Before the file: `--set a.b 3` makes `3` look like CONFIG.
    parse_override(text)
  source = source_name(path)
  if path is None:
    text = default_config_text()
  else:
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
    raise ConfigError(blame(str(err), path, overrides)) from None


def source_name(path: str | None) -> str:
  return f'<packaged {DEFAULT_CONFIG}>' if path is None else path


def blame(message: str, path: str | None, overrides: Sequence[str]) -> str:
  """Prefixes a config error with its culprit: `--set KEY=VALUE` when an override set
  the key the message names (or a key inside it, or its section), else the file."""
  if message.startswith('--set '):
    return message
  source = source_name(path)
  if message.startswith(source + ':'):
    return message
  head = message.split(':', 1)[0].strip()
  names = [(text, text.partition('=')[0].strip()) for text in reversed(overrides)]
  for text, name in names:
    if head and (head == name or head.startswith(name + '.') or name.startswith(head + '.')):
      return f'--set {text}: {message}'
  for text, name in names:  # A cross-field check that names the overridden key later.
    if re.search(rf'(?<![\w.]){re.escape(name)}(?![\w])', message):
      return f'--set {text}: {message}'
  return f'{source}: {message}'
