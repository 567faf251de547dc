"""Measures this machine's `HardwareProfile` in a few seconds, and caches it as JSON.

Every number is a real measurement through the same mechanisms the offloaded update
uses: copies between the `pinned_host` and `device` memory kinds inside `jax.jit`,
an element-wise fp32 AdamW jitted over host memory (under `compute_on('device_host')`
on an accelerator) and over device memory, and the host update timed again while a
second thread keeps the copies busy. On the CPU backend the memory kinds are nominal:
copies inside a program cost (almost) nothing, both "paths" run on the same cores, and
the profile says so (`device_is_host=True`).

`calibrate_disk` measures a directory's disk for the disk tier: a file written, read
back, and one read while another is written, with `O_DIRECT` where the filesystem takes
it (else buffered, with `fsync` after writing and the file's pages dropped from the page
cache before reading); `with_disk` puts the rates into a profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax import cache
from dos_jax import memory_spaces

from dos_jax.planner.costmodel import HardwareProfile

CACHE_DIR_ENV = cache.CACHE_DIR_ENV

# The update calibrated: AdamW with fixed hyper-parameters (their values do not
# change the cost), reading p, g, m, v and writing p, m, v, all fp32.
_B1, _B2, _LR, _EPS, _WD = 0.9, 0.999, 1e-3, 1e-8, 1e-4


def _adamw(p, g, m, v):
  m = _B1 * m + (1 - _B1) * g
  v = _B2 * v + (1 - _B2) * g * g
  step = (m / (1 - _B1)) / (jnp.sqrt(v / (1 - _B2)) + _EPS)
  return p - _LR * (step + _WD * p), m, v


def _on_host(fn: Callable) -> Callable:
  """`fn` run by the host inside a jitted program, on jax 0.10 and 0.11 alike."""
  return memory_spaces.host_region(fn, out_spaces=memory_spaces.HOST)


def _median_seconds(run: Callable[[], object], budget: float, min_reps: int = 3) -> float:
  """Median wall time of `run()` (which must block), repeated for about `budget` s."""
  run()  # compile and warm up
  times = []
  deadline = time.perf_counter() + budget
  while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < 200):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


class _Probe:
  """Jitted transfers and updates over one array size, on one device."""

  def __init__(self, n: int, device: jax.Device):
    self.n = n
    self.on_cpu = device.platform == 'cpu'
    self.dev = jax.sharding.SingleDeviceSharding(device, memory_kind='device')
    self.host = jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    self.x_host = jax.device_put(x, self.host)
    self.x_dev = jax.device_put(x, self.dev)
    self.h2d = jax.jit(lambda a: jax.device_put(a, self.dev), out_shardings=self.dev)
    self.d2h = jax.jit(lambda a: jax.device_put(a, self.host), out_shardings=self.host)
    self.both = jax.jit(
        lambda a, b: (jax.device_put(a, self.dev), jax.device_put(b, self.host)),
        out_shardings=(self.dev, self.host),
    )
    # One streamed row as the device path runs it: moments in from host memory, the
    # update in device memory, moments back out. Its cost beyond `update_dev` is what
    # the copies add inside a program (on CPU, where XLA fuses them away, nearly nothing).
    def stream_row(p, g, m, v):
      p, m, v = _adamw(p, g, jax.device_put(m, self.dev), jax.device_put(v, self.dev))
      return p, jax.device_put(m, self.host), jax.device_put(v, self.host)

    # Packing rows as the update does: leaves concatenated into one flat vector.
    self.pack = jax.jit(lambda a, b: jnp.concatenate([a, b]), out_shardings=self.dev)
    self.update_stream = jax.jit(
        stream_row, out_shardings=(self.dev, self.host, self.host), donate_argnums=(0, 2, 3)
    )
    host_update = _adamw if self.on_cpu else _on_host(_adamw)
    self.update_host = jax.jit(host_update, out_shardings=(self.host,) * 3, donate_argnums=(0, 2, 3))
    self.update_dev = jax.jit(_adamw, out_shardings=(self.dev,) * 3, donate_argnums=(0, 2, 3))
    self.state_host = self._state(rng, self.host)
    self.state_dev = self._state(rng, self.dev)
    self.state_stream = self._state(rng, self.dev)
    self.state_stream[2:] = [jax.device_put(x, self.host) for x in self.state_stream[2:]]

  def _state(self, rng, sharding):
    arrays = [rng.standard_normal(self.n, dtype=np.float32) for _ in range(4)]
    arrays[3] = np.abs(arrays[3])  # v >= 0
    return [jax.device_put(a, sharding) for a in arrays]

  def copy_h2d(self):
    jax.block_until_ready(self.h2d(self.x_host))

  def copy_d2h(self):
    jax.block_until_ready(self.d2h(self.x_dev))

  def pack_rows(self):
    jax.block_until_ready(self.pack(self.x_dev, self.state_dev[1]))

  def copy_both(self):
    jax.block_until_ready(self.both(self.x_host, self.x_dev))

  def _step(self, update, state):
    p, g, m, v = state
    p, m, v = update(p, g, m, v)
    jax.block_until_ready((p, m, v))
    state[0], state[2], state[3] = p, m, v

  def adamw_host(self):
    self._step(self.update_host, self.state_host)

  def adamw_dev(self):
    self._step(self.update_dev, self.state_dev)

  def adamw_stream(self):
    self._step(self.update_stream, self.state_stream)


def _device_free_bytes(device: jax.Device) -> float:
  stats = device.memory_stats()
  if stats and 'bytes_limit' in stats:
    return float(stats['bytes_limit'] - stats.get('bytes_in_use', 0))
  # CPU: no allocator statistics; the "device" is host RAM, of which the state,
  # params and everything else also take their share: count half of what is free.
  return 0.5 * _available_ram_bytes()


def _available_ram_bytes() -> float:
  try:
    return float(os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
  except (ValueError, OSError):
    return float(4 << 30)


def _total_ram_bytes() -> float:
  try:
    return float(os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))
  except (ValueError, OSError):
    return 0.0


def _slowdown_under_copies(probe: _Probe, alone: float, budget: float) -> float:
  """Host AdamW time while another thread keeps copies running, over `alone`."""
  stop = threading.Event()

  def copies():
    while not stop.is_set():
      probe.copy_both()

  worker = threading.Thread(target=copies, daemon=True)
  worker.start()
  try:
    contended = _median_seconds(probe.adamw_host, budget)
  finally:
    stop.set()
    worker.join()
  return max(1.0, contended / alone)


def calibrate(
    seconds_budget: float = 3.0,
    sizes: Sequence[int] = (1 << 22,),
    *,
    device: jax.Device | None = None,
    name: str | None = None,
) -> HardwareProfile:
  """Measures this machine. Rates are the best over `sizes` (fp32 elements per array);
  each of the eight (nine on CPU) measurements gets an equal share of `seconds_budget` (compiling
  comes on top: about a second on a small CPU)."""
  if not sizes or any(int(s) < 1 for s in sizes):
    raise ValueError(f'calibrate: sizes must be positive element counts, got {sizes!r}')
  if not seconds_budget > 0:
    raise ValueError(f'calibrate: seconds_budget must be > 0, got {seconds_budget!r}')
  device = device or jax.devices()[0]
  share = seconds_budget / (9 * len(sizes))
  rates: dict[str, float] = {}
  slowdowns = []
  for n in sizes:
    probe = _Probe(int(n), device)
    nbytes = 4 * probe.n
    measured = {
        'h2d': nbytes / _median_seconds(probe.copy_h2d, share),
        'd2h': nbytes / _median_seconds(probe.copy_d2h, share),
        'both': nbytes / _median_seconds(probe.copy_both, share),
        'dev': probe.n / _median_seconds(probe.adamw_dev, share),
        'pack': 2 * 2 * nbytes / _median_seconds(probe.pack_rows, share),  # read + write
    }
    host_alone = _median_seconds(probe.adamw_host, share)
    measured['host'] = probe.n / host_alone
    if probe.on_cpu:
      # The memory kinds are nominal: a standalone copy is a memcpy, but inside the
      # update's program the copies fuse away. Rate them by what they add to a streamed
      # row (8 B each way per element), at least 1% of the row so the rate stays finite.
      dev = probe.n / measured['dev']
      extra = max(_median_seconds(probe.adamw_stream, share) - dev, 0.01 * dev)
      rate = 8 * probe.n / (extra / 2)
      measured.update(h2d=rate, d2h=rate, both=rate)
    slowdowns.append(_slowdown_under_copies(probe, host_alone, 2 * share))
    for key, value in measured.items():
      rates[key] = max(rates.get(key, 0.0), value)
    del probe
  threads = os.cpu_count() or 1
  backend = device.platform
  return HardwareProfile(
      name=name or f'{socket.gethostname()}-{backend}',
      h2d_gbps=rates['h2d'] / 1e9,
      d2h_gbps=rates['d2h'] / 1e9,
      both_gbps=rates['both'] / 1e9,
      host_adamw_gparams_by_threads={threads: rates['host'] / 1e9},
      device_adamw_gparams=rates['dev'] / 1e9,
      device_copy_gbps=rates['pack'] / 1e9,
      device_free_bytes=_device_free_bytes(device),
      host_copy_slowdown=min(slowdowns),
      device_is_host=backend == 'cpu',
      host_memory_bytes=_total_ram_bytes(),
      source=(
          f'calibrate(seconds_budget={seconds_budget}, sizes={tuple(int(s) for s in sizes)})'
          f' on {socket.gethostname()}, {device.device_kind}, jax {jax.__version__},'
          f' {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}; host AdamW by XLA'
          f' under {threads} threads'
      ),
  )


def profile_path(backend: str | None = None) -> str:
  """Where this machine's profile is cached: in `dos_jax.cache.cache_dir()`
  ($DOS_JAX_CACHE_DIR, else $XDG_CACHE_HOME/dos_jax, else ~/.cache/dos_jax)."""
  root = str(cache.cache_dir())
  backend = backend or jax.default_backend()
  return os.path.join(root, f'profile-{socket.gethostname()}-{backend}.json')


def load_profile(path: str | os.PathLike) -> HardwareProfile:
  """A profile from a JSON file written by `HardwareProfile.to_json`."""
  return HardwareProfile.from_json(path)


def cached_profile(
    *, refresh: bool = False, seconds_budget: float = 3.0, sizes: Sequence[int] = (1 << 22,)
) -> HardwareProfile:
  """This machine's profile: from the cache, or calibrated now (`seconds_budget`,
  `sizes` as in `calibrate`) and cached."""
  path = profile_path()
  if not refresh and os.path.exists(path):
    try:
      return load_profile(path)
    except ValueError:
      pass  # an unreadable or outdated cache: measure again
  profile = calibrate(seconds_budget, sizes)
  profile.to_json(path)
  return profile


# The disk probe's default file size: small enough for a quick calibration, large enough
# for a few dozen of its blocks.
DISK_PROBE_BYTES = 256 << 20
_DISK_BLOCK = 8 << 20


@dataclasses.dataclass(frozen=True)
class DiskRates:
  """A directory's disk bandwidths, GB/s (see `HardwareProfile.disk_read_gbps`)."""

  read_gbps: float
  write_gbps: float
  mixed_gbps: float
  directory: str
  direct_io: bool


def _open(path: str, flags: int) -> tuple[int, bool]:
  """`path` opened with O_DIRECT where the filesystem takes it: (fd, direct)."""
  direct = getattr(os, 'O_DIRECT', 0)
  if direct:
    try:
      return os.open(path, flags | direct, 0o600), True
    except OSError:
      pass  # tmpfs and some others refuse it
  return os.open(path, flags, 0o600), False


def _write_file(path: str, size: int, block: mmap.mmap) -> bool:
  """Writes `size` bytes of `block` repeated to `path`, to the disk; returns whether
  with O_DIRECT."""
  fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  try:
    for offset in range(0, size, len(block)):
      os.pwrite(fd, block, offset)
    os.fsync(fd)
    if not direct and hasattr(os, 'posix_fadvise'):
      os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # read it from the disk
  finally:
    os.close(fd)
  return direct


def _read_file(path: str, size: int, block: mmap.mmap) -> None:
  fd, direct = _open(path, os.O_RDONLY)
  try:
    if not direct and hasattr(os, 'posix_fadvise'):
      os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    for offset in range(0, size, len(block)):
      os.preadv(fd, [block], offset)
  finally:
    os.close(fd)


def calibrate_disk(directory: str | os.PathLike, size_bytes: int = DISK_PROBE_BYTES
                   ) -> DiskRates:
  """Measures the disk under `directory` (which must exist): writes a file of
  `size_bytes` (rounded up to 8 MiB blocks), reads it back, then reads it while a
  second thread writes another, and removes both files. ValueError naming the
  directory when it is missing or cannot be written."""
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    raise ValueError(f'not a directory: {directory}')
  if size_bytes < 1:
    raise ValueError(f'calibrate_disk: size_bytes must be positive, got {size_bytes!r}')
  block_bytes = min(_DISK_BLOCK, -(-size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
  size = -(-size_bytes // block_bytes) * block_bytes
  # Page-aligned buffers, as O_DIRECT needs; random bytes, so that no disk compresses them.
  write_block, read_block = mmap.mmap(-1, block_bytes), mmap.mmap(-1, block_bytes)
  write_block[:] = np.random.default_rng(0).bytes(block_bytes)
  paths_made = [os.path.join(directory, f'.dos_jax_disk_probe.{os.getpid()}.{i}')
                for i in range(2)]
  try:
    t0 = time.perf_counter()
    direct = _write_file(paths_made[0], size, write_block)
    write = size / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    _read_file(paths_made[0], size, read_block)
    read = size / (time.perf_counter() - t0)
    writer = threading.Thread(target=_write_file, args=(paths_made[1], size, write_block))
    t0 = time.perf_counter()
    writer.start()
    _read_file(paths_made[0], size, read_block)
    writer.join()
    mixed = 2 * size / (time.perf_counter() - t0)
  except OSError as e:
    raise ValueError(f'cannot measure the disk at {directory}: {e.strerror or e}') from None
  finally:
    for path in paths_made:
      try:
        os.remove(path)
      except FileNotFoundError:
        pass
    write_block.close()
    read_block.close()
  return DiskRates(read_gbps=read / 1e9, write_gbps=write / 1e9, mixed_gbps=mixed / 1e9,
                   directory=directory, direct_io=direct)


def with_disk(profile: HardwareProfile, rates: DiskRates) -> HardwareProfile:
  """`profile` with `rates` as its disk bandwidths, measured on `rates.directory`."""
  how = 'direct I/O' if rates.direct_io else 'buffered I/O, fsync and FADV_DONTNEED'
  return dataclasses.replace(
      profile, disk_read_gbps=rates.read_gbps, disk_write_gbps=rates.write_gbps,
      disk_mixed_gbps=rates.mixed_gbps, disk_dir=rates.directory,
      source=f'{profile.source}; disk: calibrate_disk({rates.directory}) with {how}'.lstrip('; '))


def cached_disk(profile: HardwareProfile, directory: str | os.PathLike, *,
                refresh: bool = False, size_bytes: int = DISK_PROBE_BYTES) -> HardwareProfile:
  """`profile` with the disk bandwidths of `directory`: the profile's own when it was
  measured there, else those cached for this host and directory, else measured now
  (`calibrate_disk`) and cached beside this machine's profile."""
  directory = os.path.abspath(os.fspath(directory))
  if not refresh and profile.has_disk and profile.disk_dir == directory:
    return profile
  key = hashlib.sha256(directory.encode()).hexdigest()[:16]
  path = os.path.join(str(cache.cache_dir()), f'disk-{socket.gethostname()}-{key}.json')
  if not refresh and os.path.exists(path):
    try:
      with open(path, encoding='utf-8') as f:
        return with_disk(profile, DiskRates(**json.load(f)))
    except (ValueError, TypeError, OSError):
      pass  # an unreadable or outdated cache: measure again
  rates = calibrate_disk(directory, size_bytes)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(dataclasses.asdict(rates), f, indent=2)
  os.replace(tmp, path)
  return with_disk(profile, rates)
