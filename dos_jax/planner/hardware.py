"""What the cost model knows about a machine: `HardwareProfile`, and two node presets.

A profile holds the handful of rates that decide an offloaded update phase: PCIe
bandwidth each way (alone and with both directions busy), host and device AdamW
throughput, the device memory free for the update, how much the host update slows
while copies compete with it for host memory bandwidth, and, for the disk tier, a
disk's read, write and mixed bandwidth (None until measured on a directory or stated).
`dos_jax.planner.calibrate` measures one for this machine; the presets describe the
paper's nodes, with their sources.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping


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
    internode_gbps: the inter-node link of the node this device sits in, GB/s each
      way, for the data-parallel collectives of a multi-node run (`dos-jax plan
      --nodes`). Default 25: one 200 Gb/s InfiniBand HDR port at line rate (400 Gb/s
      NDR: 50). A calibration does not measure it.
    disk_read_gbps: the disk tier's read bandwidth, GB/s, on `disk_dir` (direct I/O
      where the filesystem takes it); None: no disk measured.
    disk_write_gbps: its write bandwidth, GB/s; None with `disk_read_gbps`.
    disk_mixed_gbps: bytes read plus bytes written per second while one thread reads a
      file and another writes one, GB/s (the disk tier's update does both at once);
      None: not measured, the two counted one after the other.
    disk_dir: the directory the disk bandwidths were measured on (None: stated).
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
  internode_gbps: float = 25.0
  disk_read_gbps: float | None = None
  disk_write_gbps: float | None = None
  disk_mixed_gbps: float | None = None
  disk_dir: str | None = None

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
        'internode_gbps': self.internode_gbps,
    }
    positive.update({f'host_adamw_gparams_by_threads[{t}]': r for t, r in rates.items()})
    if self.device_copy_gbps is not None:
      positive['device_copy_gbps'] = self.device_copy_gbps
    disk = {'disk_read_gbps': self.disk_read_gbps, 'disk_write_gbps': self.disk_write_gbps,
            'disk_mixed_gbps': self.disk_mixed_gbps}
    positive.update({k: v for k, v in disk.items() if v is not None})
    if (self.disk_read_gbps is None) != (self.disk_write_gbps is None) or (
        self.disk_mixed_gbps is not None and self.disk_read_gbps is None):
      raise ValueError(f'HardwareProfile {self.name!r}: disk_read_gbps and disk_write_gbps'
                       ' come together (and disk_mixed_gbps only with them)')
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
  def has_disk(self) -> bool:
    """Whether the profile knows a disk's bandwidths (measured or stated)."""
    return self.disk_read_gbps is not None

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
        ' each way plus 5 GB of bf16 weights in 1.30 s, ~23-27 GB/s; the paper also reports'
        ' 19.4/19.1 GB/s averaged over the phase): 4 GPUs and the CPU Adam share the host'
        ' memory bandwidth. host AdamW: the paper\'s CPU-only update throughput, 8.6 Gparam/s'
        ' per node (20B), / 4 GPUs; 24 threads per GPU assumed (a 96-core node). device'
        ' AdamW: H100 SXM HBM3 3.35 TB/s x 0.8 achievable / 28 B per param. device free:'
        ' 80 GB HBM less ~1 GiB for the CUDA context. host_copy_slowdown 1.0: the copies\''
        ' competition is already in both_gbps, which was measured under it. host memory:'
        ' 1 TiB per node, assumed (override with --host-memory). internode: one 400 Gb/s'
        ' InfiniBand NDR port per node at line rate, assumed (override with'
        ' --internode-gbps).'
    ),
    internode_gbps=50.0,
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
        ' 512 GiB per node. internode: 200 Gb/s per node at line rate (the field\'s'
        ' default), assumed.'
    ),
)

PROFILE_PRESETS: dict[str, HardwareProfile] = {
    H100_PCIE_GEN5_NODE.name: H100_PCIE_GEN5_NODE,
    A100_PCIE_GEN4_NODE.name: A100_PCIE_GEN4_NODE,
}
