"""The 8-bit-moment host AdamW against the fp32-state one and STREAM, in one run.

Cases, timed in alternating rounds (one run of each per round, the median over `--reps`
rounds after one warm-up), on `--params` elements in `--rows` rows, `--threads` threads:

  fp32    `adamw_host_rows` on a donated (G, 3, S) fp32 state (master, mu, nu), bf16
          gradient rows in, bf16 params out (a fresh buffer per call, as the step gets):
          28 B per element (12 B of state read and written, 2 in, 2 out).
  int8    `adamw8_host` on a donated fp32 master and 8-bit moments (codes and per-256
          scales), the same gradient and out: 16.06 B per element (4 + 1 + 1 B of state
          and 8 B of scales per 256, read and written; 2 in, 2 out).
  stream  experiments/stream_probe.c (cc -O3 -march=native -fopenmp): copy (8 B per
          element) and triad (12 B), the bandwidth the machine's memory gives.

Prints each case's time, its bytes moved / time, and the step-time ratio fp32 / int8;
then each kernel's CPU time per element at one thread (`time.process_time`, the best of
`--reps`), which tells work from waiting on memory where other processes share the cores.

  python3 experiments/bench_adamw8.py --params 64e6 --reps 5 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import dos_jax

dos_jax.keep_freed_host_memory()

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from dos_jax import kernels  # pylint: disable=wrong-import-position
from dos_jax.kernels import adamw8_reference as ref  # pylint: disable=wrong-import-position
from dos_jax.kernels import host_adamw8  # pylint: disable=wrong-import-position
from dos_jax.kernels.host_adamw_rows import adamw_host_rows  # pylint: disable=wrong-import-position

FP32_BYTES = 28.0
INT8_BYTES = 4 * 2 + 1 * 4 + 4 * 4 / ref.BLOCK_SIZE + 2 + 2


def stream(n: int, reps: int, threads: int) -> tuple[float, float] | None:
  """Best (copy, triad) seconds of stream_probe.c over n f32 elements, or None."""
  cc = shutil.which('cc') or shutil.which('gcc')
  if cc is None:
    return None
  source = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'stream_probe.c')
  with tempfile.TemporaryDirectory() as tmp:
    exe = os.path.join(tmp, 'stream_probe')
    subprocess.run([cc, '-O3', '-march=native', '-fopenmp', source, '-o', exe], check=True)
    out = subprocess.run([exe, str(n), str(reps)], check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads))).stdout
  rows = [tuple(map(float, line.split())) for line in out.splitlines()]
  return min(r[0] for r in rows), min(r[1] for r in rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=float, default=64e6)
  parser.add_argument('--rows', type=int, default=4)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--threads', type=int, default=2)
  args = parser.parse_args(argv)
  rows = args.rows
  size = -(-int(args.params) // rows) // ref.BLOCK_SIZE * ref.BLOCK_SIZE
  n = rows * size
  rng = np.random.default_rng(0)
  grad = jnp.asarray((rng.standard_normal((rows, size), np.float32) * 1e-2)).astype(
      jnp.bfloat16)
  scalars = kernels.AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                                 weight_decay=1e-4, bc1=0.1, bc2=0.001)
  print(f'{n / 1e6:.1f}M elements in {rows} rows, {args.threads} threads, '
        f'{os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}')

  @functools.partial(jax.jit, donate_argnums=(0,), static_argnames='threads')
  def fp32_step(state, g, threads=args.threads):
    new_state, out = adamw_host_rows(state, g, None, jnp.arange(rows, dtype=jnp.int32),
                                     scalars, slots=(0, 1, 2), decayed_rows=rows,
                                     lowp_dtype=jnp.bfloat16, num_threads=threads)
    return new_state, out

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2), static_argnames='threads')
  def int8_step(master, mu, nu, g, threads=args.threads):
    master, mu, nu, out = host_adamw8.adamw8_host(
        master, mu, nu, g, scalars, decayed_rows=rows, lowp_dtype=jnp.bfloat16,
        num_threads=threads)
    return master, mu, nu, out

  fp32_state = [jnp.asarray(np.stack([rng.standard_normal((rows, size), np.float32),
                                      np.zeros((rows, size), np.float32),
                                      np.zeros((rows, size), np.float32)], axis=1))]
  mu, nu = ref.zeros((rows, size))
  int8_state = [jnp.asarray(rng.standard_normal((rows, size), np.float32)),
                ref.Quantized(*map(jnp.asarray, mu)), ref.Quantized(*map(jnp.asarray, nu))]

  def run_fp32(threads=args.threads):
    state, out = fp32_step(fp32_state[0], grad, threads=threads)
    jax.block_until_ready((state, out))
    fp32_state[0] = state

  def run_int8(threads=args.threads):
    master, mu, nu, out = int8_step(*int8_state, grad, threads=threads)
    jax.block_until_ready((master, mu, nu, out))
    int8_state[:] = [master, mu, nu]

  cases = {'fp32': run_fp32, 'int8': run_int8}
  times = {k: [] for k in cases}
  for fn in cases.values():
    fn()  # compile and warm up
  for _ in range(args.reps):
    for name, fn in cases.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  med = {k: statistics.median(v) for k, v in times.items()}
  for name, bytes_per in (('fp32', FP32_BYTES), ('int8', INT8_BYTES)):
    print(f'{name:6s} {med[name] * 1e3:8.1f} ms  {bytes_per:5.2f} B/elem  '
          f'{n * bytes_per / med[name] / 1e9:6.1f} GB/s  (rounds: '
          + ' '.join(f'{t * 1e3:.0f}' for t in times[name]) + ')')
  print(f'step-time ratio fp32 / int8: {med["fp32"] / med["int8"]:.2f}x')
  for name, fn in cases.items():
    fn(threads=1)  # compile the one-thread call
    cpu = []
    for _ in range(args.reps):
      start = time.process_time()
      fn(threads=1)
      cpu.append(time.process_time() - start)
    print(f'{name:6s} one thread: {min(cpu) / n * 1e9:.2f} ns CPU time per element')
  del fp32_state[:], int8_state[:]
  probe = stream(n, args.reps, args.threads)
  if probe is None:
    print('stream: no C compiler (cc/gcc) found, skipped')
    return
  copy, triad = probe
  print(f'stream copy  {copy * 1e3:8.1f} ms  {n * 8 / copy / 1e9:6.1f} GB/s; triad '
        f'{triad * 1e3:8.1f} ms  {n * 12 / triad / 1e9:6.1f} GB/s (best of {args.reps})')
  best = max(n * 8 / copy, n * 12 / triad)
  for name, bytes_per in (('fp32', FP32_BYTES), ('int8', INT8_BYTES)):
    print(f'{name} bytes/time over STREAM best: {n * bytes_per / med[name] / best:.2f}')
  print(f'load after: {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
  main()
