"""The disk AdamW's throughput as a fraction of the disk's own, measured in one run.

In `--dir` (default: a temporary directory under the current one, on its filesystem):
  1. `dd` writes then reads a `--gib` GiB file with direct I/O (`oflag=direct
     conv=fdatasync`, `iflag=direct`, 64 MiB blocks; buffered where the filesystem
     refuses O_DIRECT; an O_DIRECT Python loop where there is no dd): the disk's write
     and read bandwidth.
  2. `adamw_disk_rows` steps over subgroups of `--subgroup-mib` MiB state files (master,
     mu, nu; bf16 gradients and out rows) totalling about `--gib` GiB: one warm-up
     step, then the median of `--reps` timed steps, each reading and writing every file.
The figure is ideal / measured, with ideal = bytes read / dd read bandwidth + bytes
written / dd write bandwidth (a half-duplex disk); 1.0 means the kernel runs at the
disk's speed. A disk that reads and writes at once (NVMe, a virtual disk) lets the
kernel's overlapped reads and writes beat that: `fraction_of_dd_full_duplex` takes the
larger of the two times as ideal instead. Prints one JSON line.

  python experiments/disk_bench.py --gib 1
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax import kernels
from dos_jax.kernels import host_adamw_disk as disk

_BLOCK = 64 << 20


def _dd(path: str, gib: float, write: bool) -> tuple[float, bool]:
  """Seconds `dd` takes to write (synced) or read `path`, and whether it used O_DIRECT."""
  count = max(1, round(gib * 1024 / 64))
  for direct in (True, False):
    if write:
      cmd = ['dd', 'if=/dev/zero', f'of={path}', 'bs=64M', f'count={count}',
             'conv=fdatasync'] + (['oflag=direct'] if direct else [])
    else:
      cmd = ['dd', f'if={path}', 'of=/dev/null', 'bs=64M'] + (['iflag=direct'] if direct else [])
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode == 0:
      return seconds, direct
  raise RuntimeError(f'{" ".join(cmd)} failed: {done.stderr.strip()}')


def _python_io(path: str, gib: float, write: bool) -> tuple[float, bool]:
  """The same as `_dd` with os.pwrite / os.preadv (no dd here)."""
  count = max(1, round(gib * 1024 / 64))
  block = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
  for direct in (True, False):
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
      fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError:
      continue
    try:
      start = time.perf_counter()
      for i in range(count):
        if write:
          os.pwrite(fd, block, i * _BLOCK)
        else:
          os.preadv(fd, [block], i * _BLOCK)
      if write:
        os.fdatasync(fd)
      return time.perf_counter() - start, direct
    finally:
      os.close(fd)
  raise RuntimeError(f'cannot open {path}')


def disk_bandwidth(directory: str, gib: float) -> dict:
  path = os.path.join(directory, 'dd.bin')
  io = _dd if shutil.which('dd') else _python_io
  try:
    write_s, write_direct = io(path, gib, write=True)
    size = os.path.getsize(path)
    read_s, read_direct = io(path, gib, write=False)
  finally:
    if os.path.exists(path):
      os.unlink(path)
  return {'tool': 'dd' if io is _dd else 'python', 'direct': write_direct and read_direct,
          'write_GBps': size / write_s / 1e9, 'read_GBps': size / read_s / 1e9}


def kernel_time(directory: str, gib: float, subgroup_mib: int, reps: int, threads,
                direct_io: bool) -> dict:
  k = 3  # master, mu, nu
  size = (subgroup_mib << 20) // (4 * k) // 1024 * 1024
  count = max(1, round(gib * 1024 / subgroup_mib))
  subgroups = list(range(count))
  rng = np.random.default_rng(0)
  state = np.stack([rng.standard_normal(size), rng.standard_normal(size) * 1e-3,
                    rng.random(size) * 1e-6]).astype(np.float32)
  for g in subgroups:
    disk.write_state(directory, g, 0, state)
  grads = jnp.asarray(rng.standard_normal((count, size)) * 1e-2, jnp.bfloat16)
  scalars = kernels.AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                                 weight_decay=1e-4, bc1=0.1, bc2=0.001)

  def step(gen):
    return disk.adamw_disk_rows(
        gen, grads, None, scalars, directory=directory, subgroups=subgroups, slots=(0, 1, 2),
        num_slots=k, decayed_rows=count // 2, lowp_dtype=jnp.bfloat16, num_threads=threads,
        direct_io=direct_io)

  gen = jax.block_until_ready(step(0))[1]  # warm-up: compiles, and every file exists twice
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    gen = jax.block_until_ready(step(gen))[1]
    times.append(time.perf_counter() - start)
  per_direction = count * disk.file_bytes(k, size)
  return {'subgroups': count, 'subgroup_bytes': disk.file_bytes(k, size),
          'bytes_read': per_direction, 'bytes_written': per_direction,
          'kernel_s': statistics.median(times), 'kernel_s_all': times}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dir', default=None,
                      help='where to write (default: a temporary directory under .)')
  parser.add_argument('--gib', type=float, default=2.0)
  parser.add_argument('--subgroup-mib', type=int, default=64)
  parser.add_argument('--reps', type=int, default=3)
  parser.add_argument('--threads', type=int, default=None)
  parser.add_argument('--buffered', action='store_true', help='the kernel without O_DIRECT')
  args = parser.parse_args(argv)
  if not disk.disk_kernel_available():
    raise SystemExit(f'no disk kernel: {disk.disk_kernel_unavailable_reason()}')
  owned = args.dir is None
  directory = tempfile.mkdtemp(prefix='disk_bench_', dir='.') if owned else args.dir
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  try:
    bandwidth = disk_bandwidth(directory, args.gib)
    kernel = kernel_time(directory, args.gib, args.subgroup_mib, args.reps, args.threads,
                         not args.buffered)
  finally:
    if owned:
      shutil.rmtree(directory, ignore_errors=True)
    else:
      for name in os.listdir(directory):
        if name.startswith('sg') and name[-2:] in ('.0', '.1'):
          os.unlink(os.path.join(directory, name))
  read_s = kernel['bytes_read'] / (bandwidth['read_GBps'] * 1e9)
  write_s = kernel['bytes_written'] / (bandwidth['write_GBps'] * 1e9)
  ideal = read_s + write_s
  moved = kernel['bytes_read'] + kernel['bytes_written']
  print(json.dumps({
      'dir': directory, 'gib': args.gib, 'subgroup_mib': args.subgroup_mib,
      'direct_io': not args.buffered, 'threads': args.threads or len(os.sched_getaffinity(0)),
      'dd': bandwidth, **kernel, 'kernel_GBps': moved / kernel['kernel_s'] / 1e9,
      'ideal_s': ideal, 'fraction_of_dd': ideal / kernel['kernel_s'],
      'fraction_of_dd_full_duplex': max(read_s, write_s) / kernel['kernel_s'],
      'jax': jax.__version__}))


if __name__ == '__main__':
  main()
