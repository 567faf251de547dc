"""Memory per tier, before anything is allocated: what a run needs against what exists.

`sizing` is the one model of a run's memory that `dos-jax plan` prints and that
`dos-jax train` checks (`check_run`) before it creates an array or a run folder:
params, grads and activations per device, the optimizer state in host memory.
`device_budget` is the device memory left for the optimizer's resident tier and
streamed buffers once params, grads and a safety margin are counted; `Auto` fills it.
`activation_bytes` is the one activation formula (this runner's model, checked on the
step compiled for an H100); `step_memory.predict_step` builds the whole compiled step's
memory on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

# Fraction of device (and host) memory kept free: allocator fragmentation, XLA's
# workspace and temporaries the model does not count.
MARGIN = 0.05
# What the backward pass keeps of one block of the runner's model
# (`dos_jax.train.model`: pre-norm, rotary, XLA's unfused causal attention with float32
# scores, SwiGLU), in elements of s (sequence) x b (micro-batch) x h (width), s b f (MLP
# hidden width) and a s^2 b (heads x scores), read off the buffers live at the peak of
# the step compiled for an H100 (experiments/memory_vs_compiled.py, RESULTS.md):
# - the stream: the block's input, its norm, q, k, v, the attention output, the stream
#   after attention and its norm, and a head-major copy of k: 9 in the compute dtype
#   (with grouped-query attention k, v and the copy are n_kv_heads / n_heads as wide);
# - the MLP: gate, up and silu(gate) * up: 3 in the compute dtype;
# - attention: the softmax probabilities in float32 and their compute-dtype copy that
#   the probabilities-times-v matmul reads.
# Korthikanti et al. 2022's 34 s b h assumes a fused (flash) attention that stores no
# scores and a GELU MLP of width 4h; this model stores a s^2 b scores per layer, which
# dominate at short widths.
# With `model.attention` 'cudnn' (cuDNN's fused flash attention) no scores are stored:
# the kernel keeps its output (counted in the stream) and the softmax statistics, one
# float32 per head and position (4 a s b), and recomputes the scores in its backward
# pass, block by block, in on-chip memory.
STREAM_TENSORS_PER_LAYER = 9
MLP_TENSORS_PER_LAYER = 3
# `model.attention` values, resolved ('auto' is the runner's choice per backend).
ATTENTION_KINDS = ('xla', 'cudnn')

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Sizing:
  """What one device and one node hold for a model, in bytes.

  Attributes:
    params: parameters per device.
    grads: gradients per device.
    activations: one micro-batch's activations per device (forward/backward).
    state_per_device: optimizer state (fp32 master if kept, m, v) per device's shard.
    num_elements: parameter elements per device (the packed state's size).
  """

  params: float
  grads: float
  activations: float
  state_per_device: float
  num_elements: int


def _check_attention(attention: str) -> None:
  if attention not in ATTENTION_KINDS:
    raise ValueError(f'attention: expected one of {", ".join(ATTENTION_KINDS)}, got'
                     f' {attention!r}')


def layer_activation_bytes(shape, *, seq_len: int, micro_batch: int,
                           compute_bytes: int = 2, attention: str = 'xla') -> float:
  """Bytes one block of the runner's model keeps for its backward pass, for one
  micro-batch: 9 c s b h + 3 c s b f + the attention's own, with c = `compute_bytes`
  (see the constants above): for 'xla' the scores, (4 + c) a s^2 b (float32 whatever
  the compute dtype; with float32 compute their copy is the same buffer); for 'cudnn'
  the softmax statistics, 4 a s b. With g = n_kv_heads / n_heads < 1, the three
  key/value tensors of the 9 count g each."""
  s, b, c = seq_len, micro_batch, compute_bytes
  kv_narrowing = 3 * (1 - shape.kv_heads / shape.n_heads)
  return float((STREAM_TENSORS_PER_LAYER - kv_narrowing) * c * s * b * shape.dim
               + MLP_TENSORS_PER_LAYER * c * s * b * shape.ffn_dim
               + _attention_bytes(shape, s, b, c, attention))


def _attention_bytes(shape, seq_len: int, micro_batch: int, compute_bytes: int,
                     attention: str) -> float:
  _check_attention(attention)
  if attention == 'cudnn':
    return float(4 * shape.n_heads * seq_len * micro_batch)
  c = compute_bytes
  return float(shape.n_heads * seq_len * seq_len * micro_batch * (4 + (c if c < 4 else 0)))


def _score_gradient_bytes(shape, seq_len: int, micro_batch: int, compute_bytes: int,
                          attention: str) -> float:
  """The last layer's attention gradient being made at the start of the backward pass:
  for 'xla' the score gradient, (4 + c) a s^2 b; for 'cudnn', whose kernel makes no
  scores, its dq, dk and dv in the compute dtype and dq and dk through the rotary
  positions in float32, (3 c + 8) s b h (read off the step compiled for an H100)."""
  if attention == 'cudnn':
    return float((3 * compute_bytes + 8) * seq_len * micro_batch * shape.dim)
  return _attention_bytes(shape, seq_len, micro_batch, compute_bytes, attention)


def activation_bytes(shape, *, seq_len: int, micro_batch: int, compute_bytes: int = 2,
                     remat: bool = False, attention: str = 'xla') -> float:
  """Device bytes the forward and backward passes of one micro-batch hold at their peak
  (the start of the backward pass), for the runner's model: every layer's
  `layer_activation_bytes`, the float32 logits and their gradient (2 x 4 s b V), and
  the last layer's attention gradient being made (`_score_gradient_bytes`). With
  `remat`, each block keeps only its input (c s b h) and one block's activations are
  rebuilt at a time. `attention` is the resolved kind, 'xla' or 'cudnn'. Under ZeRO-3
  `micro_batch` is a device's share: the model keeps the activations batch-split."""
  s, b, c = seq_len, micro_batch, compute_bytes
  per_layer = layer_activation_bytes(shape, seq_len=s, micro_batch=b, compute_bytes=c,
                                     attention=attention)
  if remat:
    layers = shape.n_layers * c * s * b * shape.dim + per_layer
  else:
    layers = shape.n_layers * per_layer
  transient = _score_gradient_bytes(shape, s, b, c, attention)
  return float(layers + transient + 2 * 4 * s * b * shape.vocab_size)


def sizing(shape, *, param_bytes: int, state_bytes: int, devices: int, seq_len: int,
           micro_batch: int, remat: bool = False, compute_bytes: int = 2,
           attention: str = 'xla') -> Sizing:
  """Per-device sizes with params, grads and state sharded over `devices` (as ZeRO-3 /
  FSDP or a tensor split would) and one micro-batch of activations per device
  (`activation_bytes`, in the compute dtype whatever the params' dtype)."""
  n = shape.num_params()
  per_device = math.ceil(n / devices)
  acts = activation_bytes(shape, seq_len=seq_len, micro_batch=micro_batch,
                          compute_bytes=compute_bytes, remat=remat, attention=attention)
  return Sizing(
      params=per_device * param_bytes, grads=per_device * param_bytes, activations=acts,
      state_per_device=per_device * state_bytes, num_elements=per_device,
  )


def device_budget(device_bytes: float, size: Sizing, margin: float = MARGIN) -> float:
  """Device memory the optimizer may use beside the model (resident state, streamed
  buffers; activations still to be counted against it): the device's memory less the
  margin, params and grads. Never negative."""
  return max(device_bytes * (1 - margin) - size.params - size.grads, 0.0)


def gib(n: float) -> str:
  return f'{n / _GIB:,.1f} GiB'


@dataclasses.dataclass(frozen=True)
class Shortfall:
  """One memory that is too small: what needs it, how much, how much there is."""

  memory: str  # e.g. 'device memory (each of 4)', 'host memory'
  needed: float
  available: float
  parts: str  # what `needed` is made of

  def line(self) -> str:
    return (f'{self.memory} short by {gib(self.needed - self.available)}: needs'
            f' {gib(self.needed)} ({self.parts}), {gib(self.available)} available')


def shortfalls(size: Sizing, *, devices: int, device_bytes: float, host_bytes: float,
               device_is_host: bool, margin: float = MARGIN) -> list[Shortfall]:
  """What does not fit, with everything offloadable on the host (AllHost: the least
  device memory any plan needs). `host_bytes` 0 means unknown (not checked).

  On the CPU backend the "device" is host memory, so both needs are one sum against
  the host's memory."""
  model = size.params + size.grads + size.activations
  state = size.state_per_device * devices
  parts = (f'params {gib(size.params)} + grads {gib(size.grads)} + activations'
           f' {gib(size.activations)}')
  if device_is_host:
    needed = model * devices + state
    available = host_bytes * (1 - margin)
    if host_bytes and needed > available:
      return [Shortfall('host memory', needed, available,
                        f'{parts} per device, x{devices}, + optimizer state {gib(state)}')]
    return []
  out = []
  if model > device_bytes * (1 - margin):
    out.append(Shortfall(f'device memory (each of {devices})', model,
                         device_bytes * (1 - margin), parts))
  if host_bytes and state > host_bytes * (1 - margin):
    out.append(Shortfall('pinned host memory', state, host_bytes * (1 - margin),
                         f'optimizer state of {devices} device(s)'))
  return out


def host_available_bytes() -> float:
  """Host memory available now: /proc/meminfo's MemAvailable, else free pages (0 when
  neither is readable)."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return float(os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
  except (ValueError, OSError, AttributeError):
    return 0.0


def device_available_bytes(device) -> float | None:
  """Free memory of `device` from its allocator's statistics, or None when the backend
  keeps none (the CPU backend)."""
  stats = getattr(device, 'memory_stats', lambda: None)()
  if not stats or 'bytes_limit' not in stats:
    return None
  return float(stats['bytes_limit'] - stats.get('bytes_in_use', 0))


_DTYPE_BYTES = {'float32': 4, 'bfloat16': 2}


def _run_sizing(cfg, count: int) -> Sizing:
  """A run config's per-device sizes over `count` local devices (see `check_run`)."""
  shape = cfg.model.shape()
  param_bytes = _DTYPE_BYTES.get(str(cfg.model.param_dtype), 4)
  state_bytes = 12 if param_bytes < 4 else 8
  mesh = cfg.mesh
  data = mesh.data if mesh.data > 0 else max(
      count // (mesh.fsdp * mesh.tensor * mesh.pipeline), 1)
  micro_batch = max(cfg.data.batch_size // (data * mesh.fsdp), 1)
  return sizing(shape, param_bytes=param_bytes, state_bytes=state_bytes, devices=count,
                seq_len=cfg.data.seq_len, micro_batch=micro_batch,
                remat=bool(cfg.model.remat),
                compute_bytes=_DTYPE_BYTES.get(str(cfg.model.compute_dtype), 2),
                attention=cfg.model.attention_impl())  # the backend has started


def run_pinned_bytes(cfg, processes: int = 1, local_devices: int | None = None) -> float:
  """Pinned host bytes per process of a run config, as `dos-jax train` sizes XLA's
  pinned-host pool before any backend starts: the host tiers of the whole state (every
  subgroup on the host: the most any plan pins), plus the step's host-bound gradients
  and the host update's new parameters.

  The state is split over one axis (`data`, or `fsdp` with ZeRO-3) and whole on every
  device of the others, so a process holds `local devices / that axis` times the
  model's state: `tensor x pipeline / processes` times it without fsdp, whatever the
  device count (for pipelined runs an upper bound: each stage holds only its layers);
  with fsdp also times `data`, which with `mesh.data: -1` needs `local_devices` (None:
  taken as 1 data replica). 0 when nothing is offloaded ('none', 'all_device').
  """
  if cfg.offload.policy in ('none', 'all_device'):
    return 0.0
  param_bytes = _DTYPE_BYTES.get(str(cfg.model.param_dtype), 4)
  state_bytes = 12 if param_bytes < 4 else 8
  if cfg.optim.mu_dtype == 'bfloat16':
    state_bytes -= 2
  per_element = state_bytes + 2 * param_bytes  # + gradient in, new parameter out
  if _may_speculate(cfg):  # early host calls' undo: at most the state once more
    per_element += state_bytes
  mesh = cfg.mesh
  replicas = mesh.tensor * mesh.pipeline / max(processes, 1)
  if mesh.fsdp > 1:
    if mesh.data > 0:
      replicas *= mesh.data
    elif local_devices:
      replicas = max(local_devices // (mesh.fsdp * mesh.tensor), 1) * mesh.tensor
  return float(cfg.model.shape().num_params() * per_element * replicas)


def _may_speculate(cfg) -> bool:
  """Whether a run's early host calls may keep an undo copy of host state: a clip norm,
  on the two-memory program (a GPU run, or `offload.platform: gpu`), where every
  offloading policy gets them (`Partition.early`); the one-memory program
  (`offload.platform: cpu`) has none."""
  return cfg.optim.clip_norm is not None and cfg.offload.platform != 'cpu'


def check_run(cfg, linked_back_bytes: float = 0.0) -> str | None:
  """Checks a run config (`dos_jax.train.config.RunConfig`) against this machine's
  memory before anything is allocated; returns one line naming the shortfall, or None.
  `linked_back_bytes`: the disk tier's state that the checkpoint being resumed holds
  as files, linked back into `offload.disk_dir` rather than written (no new space).

  Uses the same sizing as `dos-jax plan`: params, grads and the state sharded over the
  local devices, one micro-batch of activations per data-parallel device."""
  import jax  # pylint: disable=import-outside-toplevel  # the backend starts here

  devices = jax.local_devices()
  count = len(devices)
  size = _run_sizing(cfg, count)
  device_is_host = devices[0].platform == 'cpu'
  free = None if device_is_host else device_available_bytes(devices[0])
  disk_dir = getattr(cfg.offload, 'disk_dir', None)
  on_disk = 0.0
  if disk_dir is not None:  # the state beyond offload.host_state_gib goes to disk
    state = size.state_per_device * count
    cap = cfg.offload.host_state_gib
    in_host = 0.0 if cap is None else min(state, cap * _GIB)
    on_disk = (state - in_host) * _state_copies(cfg, count)  # each device its own files
    size = dataclasses.replace(size, state_per_device=in_host / count)
  short = shortfalls(size, devices=count, device_bytes=free or math.inf,
                     host_bytes=host_available_bytes(), device_is_host=device_is_host)
  if on_disk:
    space = disk_free_bytes(disk_dir)
    reused, linked = disk_state_bytes(disk_dir)
    shared = min(max(linked, linked_back_bytes), on_disk)
    need, have = 2 * on_disk - shared, (space + reused) * (1 - MARGIN)
    if space and need > have:  # two generations of each file
      short.append(Shortfall(f'disk at offload.disk_dir={disk_dir}', need, have,
                             'two generations of the state on disk'))
  if not short:
    return None
  shape = cfg.model.shape()
  name = f'model.preset={cfg.model.preset}' if cfg.model.preset else 'the model'
  hint = ''
  if disk_dir is None and any('host' in s.memory for s in short):
    hint = ' (offload.disk_dir puts the state beyond host memory on disk)'
  return (f'{name} ({shape.num_params() / 1e9:.2f}B params) does not fit this machine: '
          + '; '.join(s.line() for s in short) + hint)


def _state_copies(cfg, count: int) -> int:
  """The copies of the state on a run's `count` local devices: one per device of the
  mesh axes other than the one the state is split over (`fsdp` with ZeRO-3, else
  `data`) and `pipeline` (whose stages hold other layers)."""
  mesh = cfg.mesh
  split = mesh.fsdp if mesh.fsdp > 1 else (
      mesh.data if mesh.data > 0 else count // (mesh.tensor * mesh.pipeline))
  return max(count // (max(split, 1) * mesh.pipeline), 1)


def disk_state_bytes(directory: str) -> tuple[float, float]:
  """`(reused, linked)`: bytes of the disk tier's files already in `directory` (an
  earlier run's), those the run replaces and frees, and those a checkpoint links too
  (more than one link): a resume links that generation back instead of writing it."""
  from dos_jax.kernels import host_adamw_disk  # pylint: disable=import-outside-toplevel
  reused = linked = 0.0
  try:
    entries = list(os.scandir(directory))
  except OSError:
    return 0.0, 0.0
  seen = set()  # each file once: a generation-0 file is linked to by every copy
  for entry in entries:
    if not host_adamw_disk.STATE_FILE.fullmatch(entry.name):
      continue
    try:
      info = entry.stat(follow_symlinks=False)
    except OSError:
      continue
    if (info.st_dev, info.st_ino) in seen:
      continue
    seen.add((info.st_dev, info.st_ino))
    if info.st_nlink > 1:
      linked += info.st_size
    else:
      reused += info.st_size
  return reused, linked


def existing_parent(path: str) -> str:
  """`path` made absolute, or its nearest existing parent: where a folder not made yet
  will be (its filesystem)."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def disk_free_bytes(directory: str) -> float:
  """Free bytes of the filesystem that holds `directory` (or would: its nearest existing
  parent); 0 when unknown."""
  try:
    return float(shutil.disk_usage(existing_parent(directory)).free)
  except OSError:
    return 0.0


def run_budget(cfg, devices, device_bytes: float | None = None) -> tuple[float, float] | None:
  """`(budget_bytes, activation_bytes)` for a run's `Auto` on `devices`: the device
  memory beyond params, grads and the margin that the resident tier and the streamed
  buffers may use, and the activations that must still fit beside them. None where the
  devices are the host (the CPU backend: nothing to keep resident) or report no memory.

  `device_bytes` replaces the free memory read from the first device's allocator."""
  if device_bytes is None:
    if devices[0].platform == 'cpu':
      return None
    device_bytes = device_available_bytes(devices[0])
    if device_bytes is None:
      return None
  size = _run_sizing(cfg, len(devices))
  return device_budget(device_bytes, size), size.activations
