"""The cost model: what one update phase costs on a given machine, for a given plan.

A `HardwareProfile` holds the handful of rates that decide the update phase: PCIe
bandwidth each way (alone and with both directions busy), host and device AdamW
throughput, the device memory free once the backward pass has released its
activations, and how much the host update slows while copies compete with it for host
memory bandwidth. `predict` turns a profile, the shape of the packed state
(`SubgroupSpec`) and a `Plan` into a `Prediction` of the update phase.

The model is a roofline over four resources that work at once (host cores, device,
the H2D link, the D2H link):

* device subgroups go through a pipeline of `plan.buffers` device buffers: state in
  (H2D), the fused AdamW, state out (D2H). Each subgroup holds a buffer from the start
  of its H2D to the end of its D2H, so the steady-state period per subgroup is
  `max(h, c, d, (h + c + d) / buffers)`, plus one full latency `h + c + d` to fill and
  drain the pipeline;
* host subgroups need their gradients D2H (hidden behind the backward pass as far as it
  lasts; fp32 params, which are their own master, go along), the host AdamW, and their
  new low-precision params H2D;
* both paths run concurrently; the host AdamW runs `host_copy_slowdown` times slower
  while the device stream's copies run (they share host memory bandwidth);
* packing gradients into subgroup rows before, and unpacking the new rows into the
  params after, cost device-memory traffic (`layout_bytes`) outside both paths;
* the update phase lasts as long as the slowest path or link. On a machine whose
  "device" is the host itself (`device_is_host`, the CPU backend), the two paths use
  the same cores and memory, so their times add instead.

With a fast device and the state copies hidden, this reduces to the paper's rule
(PAPER.md, the method, point 6): one device subgroup in every k hides behind the host
work on the other k-1 when (k-1)/U_host >= 12/B, i.e. k >= 1 + 12 U_host / B.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """Rates of one accelerator and its share of the host, as the cost model needs them.

  Attributes:
    name: a short label for reports.
    h2d_gbps: host -> device bandwidth, GB/s (1e9 bytes/s), one direction alone.
    d2h_gbps: device -> host bandwidth, GB/s, one direction alone.
    both_gbps: bandwidth of each direction while both run at once, GB/s.
    host_adamw_gparams_by_threads: host AdamW throughput (1e9 fp32 params/s, reading
      p, g, m, v and writing p, m, v) by the number of host threads it uses.
    device_adamw_gparams: the same update's throughput in device memory, 1e9 params/s.
    device_free_bytes: device memory free for the update phase, before the model's
      params and grads are counted (a calibration measures it on an idle device).
    host_copy_slowdown: factor (>= 1) by which the host AdamW slows while PCIe copies
      run, because both stream through host memory.
    device_is_host: True when the "device" is the host's own cores (the CPU backend):
      the device and host paths then serialize instead of overlapping.
    host_memory_bytes: host memory that can be pinned for the state (0 when unknown).
    host_threads: threads the host update runs with; None means the best measured.
    source: where the numbers come from (a calibration, or the sources of a preset).
    device_copy_gbps: device memory bandwidth for packing and unpacking the subgroup
      rows, GB/s (read + write counted); None: what the device AdamW achieves, 28 B
      per param.
  """

  name: str
  h2d_gbps: float
  d2h_gbps: float
  both_gbps: float
  host_adamw_gparams_by_threads: Mapping[int, float]
  device_adamw_gparams: float
  device_free_bytes: float
  host_copy_slowdown: float = 1.0
  device_is_host: bool = False
  host_memory_bytes: float = 0.0
  host_threads: int | None = None
  source: str = ''
  device_copy_gbps: float | None = None

  def __post_init__(self):
    rates = {
        int(threads): float(rate)
        for threads, rate in dict(self.host_adamw_gparams_by_threads).items()
    }
    if not rates:
      raise ValueError(f'{self.name}: host_adamw_gparams_by_threads is empty')
    object.__setattr__(self, 'host_adamw_gparams_by_threads', dict(sorted(rates.items())))
    positive = {
        'h2d_gbps': self.h2d_gbps,
        'd2h_gbps': self.d2h_gbps,
        'both_gbps': self.both_gbps,
        'device_adamw_gparams': self.device_adamw_gparams,
        'device_free_bytes': self.device_free_bytes,
        'host_copy_slowdown': self.host_copy_slowdown,
    }
    positive.update({f'host_adamw_gparams_by_threads[{t}]': r for t, r in rates.items()})
    if self.device_copy_gbps is not None:
      positive['device_copy_gbps'] = self.device_copy_gbps
    for key, value in positive.items():
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f'HardwareProfile {self.name!r}: {key} must be a positive number, got {value!r}')
    if self.host_copy_slowdown < 1.0:
      raise ValueError(
          f'HardwareProfile {self.name!r}: host_copy_slowdown must be >= 1, got {self.host_copy_slowdown}'
      )
    if self.host_memory_bytes < 0:
      raise ValueError(f'HardwareProfile {self.name!r}: host_memory_bytes must be >= 0')
    if self.host_threads is not None and self.host_threads not in rates:
      raise ValueError(
          f'HardwareProfile {self.name!r}: host_threads={self.host_threads} has no measured'
          f' throughput (measured: {sorted(rates)})'
      )

  def __hash__(self):
    fields = dataclasses.astuple(self)
    return hash(fields[:4] + (tuple(self.host_adamw_gparams_by_threads.items()),) + fields[5:])

  def host_adamw_gparams(self, threads: int | None = None) -> float:
    """Host AdamW throughput at `threads` (default `host_threads`, else the best)."""
    threads = self.host_threads if threads is None else threads
    if threads is None:
      return max(self.host_adamw_gparams_by_threads.values())
    return self.host_adamw_gparams_by_threads[threads]

  @property
  def device_memory_gbps(self) -> float:
    """Device memory bandwidth for the pack/unpack around the update paths."""
    if self.device_copy_gbps is not None:
      return self.device_copy_gbps
    return ADAMW_BYTES_PER_PARAM * self.device_adamw_gparams

  def scaled(
      self, *, host: float = 1.0, stream: float = 1.0, links: float = 1.0, name: str | None = None
  ) -> HardwareProfile:
    """A copy with throughputs multiplied by factors: the host AdamW by `host`, the
    device stream (links and device AdamW) by `stream`, the links alone by `links`.
    How `Auto` corrects a profile. The pack/unpack bandwidth stays as it was."""
    return dataclasses.replace(
        self,
        device_copy_gbps=self.device_memory_gbps,
        name=name or self.name,
        host_adamw_gparams_by_threads={
            t: r * host for t, r in self.host_adamw_gparams_by_threads.items()
        },
        h2d_gbps=self.h2d_gbps * stream * links,
        d2h_gbps=self.d2h_gbps * stream * links,
        both_gbps=self.both_gbps * stream * links,
        device_adamw_gparams=self.device_adamw_gparams * stream,
    )

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out['host_adamw_gparams_by_threads'] = {
        str(t): r for t, r in self.host_adamw_gparams_by_threads.items()
    }
    return out

  @classmethod
  def from_dict(cls, data: Mapping, *, origin: str = 'profile') -> HardwareProfile:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
      raise ValueError(f'{origin}: unknown key(s) {", ".join(unknown)}')
    try:
      return cls(**data)
    except TypeError as e:  # a missing key
      raise ValueError(f'{origin}: {e}') from None

  def to_json(self, path: str | os.PathLike | None = None) -> str:
    """The profile as JSON text; also written to `path` when one is given."""
    text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
    if path is not None:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      tmp = f'{path}.tmp{os.getpid()}'
      with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text + '\n')
      os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return text

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> HardwareProfile:
    """Reads a profile written by `to_json`; errors name the file."""
    try:
      with open(path, encoding='utf-8') as f:
        data = json.load(f)
    except FileNotFoundError:
      raise ValueError(f'profile file not found: {path}') from None
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}: not valid JSON ({e})') from None
    if not isinstance(data, dict):
      raise ValueError(f'{path}: expected a JSON object')
    return cls.from_dict(data, origin=str(path))


# Bytes moved per parameter by one fp32 AdamW step in device memory: read p, g, m, v and
# write p, m, v (7 x 4 B), the figure the device presets divide HBM bandwidth by.
ADAMW_BYTES_PER_PARAM = 28

H100_PCIE_GEN5_NODE = HardwareProfile(
    name='h100-pcie5',
    h2d_gbps=53.0,
    d2h_gbps=50.0,
    both_gbps=25.0,
    host_adamw_gparams_by_threads={24: 8.6 / 4},
    device_adamw_gparams=0.8 * 3350 / ADAMW_BYTES_PER_PARAM,
    device_free_bytes=79 * 2**30,
    host_copy_slowdown=1.0,
    host_memory_bytes=1024 * 2**30,
    source=(
        'One GPU of a 4x H100 80GB node on PCIe Gen5 x16. h2d/d2h: Gen5 x16 is 64 GB/s'
        ' per direction in theory, ~50-55 GB/s measured with pinned memory; both: the'
        ' per-direction rate implied by the paper\'s 20B k=2 update (2.5e9 params/GPU x 12 B'
        ' each way plus 5 GB of bf16 weights in 1.30 s, ~23-27 GB/s; PAPER.md also reports'
        ' 19.4/19.1 GB/s averaged over the phase): 4 GPUs and the CPU Adam share the host'
        ' memory bandwidth. host AdamW: the paper\'s CPU-only update throughput, 8.6 Gparam/s'
        ' per node (20B), / 4 GPUs; 24 threads per GPU assumed (a 96-core node). device'
        ' AdamW: H100 SXM HBM3 3.35 TB/s x 0.8 achievable / 28 B per param. device free:'
        ' 80 GB HBM less ~1 GiB for the CUDA context. host_copy_slowdown 1.0: the copies\''
        ' competition is already in both_gbps, which was measured under it. host memory:'
        ' 1 TiB per node, assumed (override with --host-memory).'
    ),
)

A100_PCIE_GEN4_NODE = HardwareProfile(
    name='a100-pcie4',
    h2d_gbps=25.0,
    d2h_gbps=24.0,
    both_gbps=10.0,
    host_adamw_gparams_by_threads={8: 3.8 / 4},
    device_adamw_gparams=0.8 * 1555 / ADAMW_BYTES_PER_PARAM,
    device_free_bytes=39 * 2**30,
    host_copy_slowdown=1.0,
    host_memory_bytes=512 * 2**30,
    source=(
        'One GPU of a 4x A100 40GB node on PCIe Gen4 x16 (a Polaris-like node: 512 GB'
        ' DDR4). h2d/d2h: Gen4 x16 is 32 GB/s per direction in theory, ~25 GB/s measured'
        ' with pinned memory; both: the per-direction rate implied by the paper\'s 20B k=2'
        ' update on 4x A100 (5.7 Gparam/s per node: 2.5e9 params/GPU x 12 B each way in'
        ' 3.5 s, ~9-10 GB/s). host AdamW: the paper\'s CPU-only 3.8 Gparam/s per node (20B)'
        ' / 4 GPUs; 8 threads per GPU assumed. device AdamW: A100 40GB HBM2 1.555 TB/s x'
        ' 0.8 / 28 B per param. device free: 40 GB less ~1 GiB of context. host memory:'
        ' 512 GiB per node.'
    ),
)

PROFILE_PRESETS: dict[str, HardwareProfile] = {
    H100_PCIE_GEN5_NODE.name: H100_PCIE_GEN5_NODE,
    A100_PCIE_GEN4_NODE.name: A100_PCIE_GEN4_NODE,
}


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The predicted update phase of one plan.

  Attributes:
    update_seconds: the whole update phase (after the backward pass).
    device_stream_seconds: the device path alone (copies in, device AdamW, copies out).
    host_seconds: the host path alone (exposed gradient copies, host AdamW slowed by
      the copies it competes with, params back to the device).
    bytes_h2d: bytes moved host -> device (device subgroups' state, host subgroups'
      new low-precision params).
    bytes_d2h: bytes moved device -> host (device subgroups' state, host subgroups'
      gradients, including those hidden behind the backward pass).
    grad_transfer_hidden_seconds: how much of the host subgroups' gradient copies
      hides behind the backward pass.
    device_peak_bytes: device memory the update needs beyond params and grads.
    bound: what limits the update: 'device stream', 'host', 'H2D link', 'D2H link',
      'resident' or 'serialized' (device_is_host).
    layout_seconds: packing gradients (and fp32 params) into subgroup rows before the
      paths run, and unpacking the new rows into updates applied to the params after;
      part of `update_seconds`.
  """

  update_seconds: float
  device_stream_seconds: float
  host_seconds: float
  bytes_h2d: float
  bytes_d2h: float
  grad_transfer_hidden_seconds: float
  device_peak_bytes: float
  bound: str
  layout_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class IterationPrediction:
  """A whole training iteration: forward + backward + the predicted update phase."""

  forward_seconds: float
  backward_seconds: float
  update: Prediction

  @property
  def iteration_seconds(self) -> float:
    return self.forward_seconds + self.backward_seconds + self.update.update_seconds


def subgroup_sizes(spec: SubgroupSpec) -> list[int]:
  """Real elements per subgroup: all full except possibly the last."""
  n, size = spec.num_subgroups, spec.subgroup_size
  last = spec.num_elements - (n - 1) * size
  if n < 1 or size < 1 or not 0 < last <= size:
    raise ValueError(
        f'inconsistent SubgroupSpec: {spec.num_elements} elements in {n} subgroups of {size}'
    )
  return [size] * (n - 1) + [last]


def master_kept(spec: SubgroupSpec) -> bool:
  """Whether the host state holds a separate fp32 master copy: it does when the params
  are below fp32; fp32 params are their own master and stay on the device."""
  return spec.param_bytes_per_element < 4


def host_pull_bytes(spec: SubgroupSpec) -> int:
  """Bytes per element a host subgroup pulls device -> host: its gradients, and its
  params too when no master copy lives on the host."""
  extra = 0 if master_kept(spec) else spec.param_bytes_per_element
  return spec.grad_bytes_per_element + extra


def layout_bytes(spec: SubgroupSpec) -> int:
  """Device-memory traffic per element around the two paths: gradients packed into
  rows (read + write), fp32 params packed too when they are the master, the output rows
  initialized, and the new rows unpacked into updates that `optax.apply_updates` adds
  to the params (read row and param, write param)."""
  pb, gb = spec.param_bytes_per_element, spec.grad_bytes_per_element
  params_packed = 0 if master_kept(spec) else 2 * pb
  return 2 * gb + params_packed + pb + 3 * pb


def _slowed(work: float, window: float, slowdown: float) -> float:
  """Time for `work` seconds of host compute when it runs `slowdown` times slower
  during the first `window` seconds (while copies run) and at full speed after."""
  if work * slowdown <= window:
    return work * slowdown
  return window + (work - window / slowdown)


def predict(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    *,
    backward_seconds: float = 0.0,
) -> Prediction:
  """Predicts the update phase of `plan` on `profile` (see the module docstring).

  Args:
    profile: the machine.
    spec: the packed state (subgroup count and size, bytes per element).
    plan: which subgroups go where.
    backward_seconds: length of the backward pass, during which the host subgroups'
      gradient copies can already run (0: nothing hides).
  """
  if plan.num_subgroups != spec.num_subgroups:
    raise ValueError(
        f'plan names {plan.num_subgroups} subgroups but the spec has {spec.num_subgroups}'
    )
  sizes = subgroup_sizes(spec)
  sb, pb = spec.state_bytes_per_element, spec.param_bytes_per_element
  gb = host_pull_bytes(spec)
  u_dev = profile.device_adamw_gparams * _GB
  u_host = profile.host_adamw_gparams() * _GB

  layout = spec.num_elements * layout_bytes(spec) / (profile.device_memory_gbps * _GB)
  if plan.resident:
    seconds = spec.num_elements / u_dev
    return Prediction(
        update_seconds=seconds + layout, device_stream_seconds=seconds, host_seconds=0.0,
        bytes_h2d=0.0, bytes_d2h=0.0, grad_transfer_hidden_seconds=0.0,
        device_peak_bytes=float(sb * spec.num_subgroups * spec.subgroup_size),
        bound='resident', layout_seconds=layout,
    )

  dev_sizes = [sizes[i] for i in plan.device]
  host_elements = sum(sizes[i] for i in plan.host)
  serial = profile.device_is_host
  # Both directions carry traffic at once only when the device stream overlaps.
  both = bool(dev_sizes) and not serial and (plan.buffers >= 2 or bool(plan.host))
  h2d_bw = (profile.both_gbps if both else profile.h2d_gbps) * _GB
  d2h_bw = (profile.both_gbps if both else profile.d2h_gbps) * _GB

  stream = 0.0
  if dev_sizes:
    # A single buffer cannot overlap its own copies: those run at the lone-direction rate.
    in_bw = h2d_bw if plan.buffers >= 2 else profile.h2d_gbps * _GB
    out_bw = d2h_bw if plan.buffers >= 2 else profile.d2h_gbps * _GB
    latencies = []
    for s in dev_sizes:
      h, c, d = sb * s / in_bw, s / u_dev, sb * s / out_bw
      if serial:
        stream += h + c + d
      else:
        stream += max(h, c, d, (h + c + d) / plan.buffers)
        latencies.append((h + c + d) - max(h, c, d, (h + c + d) / plan.buffers))
    if latencies:
      stream += latencies[0]  # filling the pipeline: the first subgroup's whole latency

  grad_seconds = gb * host_elements / d2h_bw
  hidden = min(grad_seconds, max(backward_seconds, 0.0))
  exposed = grad_seconds - hidden
  param_seconds = pb * host_elements / h2d_bw
  host = 0.0
  if plan.host:
    work = host_elements / u_host
    compute = work if serial else _slowed(work, stream, profile.host_copy_slowdown)
    first, last = sizes[plan.host[0]], sizes[plan.host[-1]]
    # The first subgroup's exposed gradients must arrive before its update starts, and
    # the last one's params go back after it ends; the rest pipelines.
    fill = exposed * first / host_elements
    drain = pb * last / h2d_bw
    if serial:
      host = exposed + work + param_seconds
    else:
      host = fill + max(exposed, compute, param_seconds) + drain

  bytes_h2d = float(sb * sum(dev_sizes) + pb * host_elements)
  bytes_d2h = float(sb * sum(dev_sizes) + gb * host_elements)
  if serial:
    update, bound = stream + host, 'serialized'
  else:
    h2d_link = (bytes_h2d) / h2d_bw
    d2h_link = (bytes_d2h - gb * host_elements * (hidden / grad_seconds if grad_seconds else 0)) / d2h_bw
    update, bound = max(
        (stream, 'device stream'), (host, 'host'), (h2d_link, 'H2D link'), (d2h_link, 'D2H link'),
        key=lambda item: item[0],
    )
  peak = float(sb * plan.buffers * max(dev_sizes)) if dev_sizes else 0.0
  return Prediction(
      update_seconds=update + layout, device_stream_seconds=stream, host_seconds=host,
      bytes_h2d=bytes_h2d, bytes_d2h=bytes_d2h, grad_transfer_hidden_seconds=hidden,
      device_peak_bytes=peak, bound=bound, layout_seconds=layout,
  )


def predict_iteration(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    *,
    forward_seconds: float = 0.0,
    backward_seconds: float = 0.0,
) -> IterationPrediction:
  """A whole iteration: the given forward and backward times plus the update phase,
  with the host subgroups' gradient copies hidden behind the backward pass."""
  update = predict(profile, spec, plan, backward_seconds=backward_seconds)
  return IterationPrediction(forward_seconds, backward_seconds, update)
