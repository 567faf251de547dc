"""Throughput of the AdamW kernels against jitted optax and a memory-bandwidth probe.

CPU (always): the native host AdamW at 1 and 2 threads, `jax.jit(optax.adamw)` (update
+ apply, donated), DeepSpeedCPUAdam when `deepspeed` is importable, and numpy streaming
probes that bound what any AdamW can do: an update reads and writes master, m, v and
reads the gradient, 28 bytes per parameter with fp32 gradients and no 16-bit copy (or
bf16 gradients plus a bf16 copy), so Gparam/s <= probe GB/s / 28.
GPU (only where JAX sees one): the Pallas AdamW, jitted optax and a device copy at
16M-256M parameters.

  python experiments/bench_kernels.py                      # 64M params, prints a table
  python experiments/bench_kernels.py --out experiments/results_kernels.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dos_jax import kernels

BYTES_PER_PARAM = 28  # read p, m, v, g (16) + write p, m, v (12), fp32 everywhere


@dataclasses.dataclass(frozen=True)
class Row:
  what: str
  seconds: float  # median of the timed repetitions
  size: int  # parameters (or f32 elements for probes)
  bytes_per_elem: int

  @property
  def gparams(self) -> float:
    return self.size / self.seconds / 1e9

  @property
  def gbytes(self) -> float:
    return self.size * self.bytes_per_elem / self.seconds / 1e9


def _median(step: Callable, carry, reps: int, warmup: int = 2) -> tuple[float, object]:
  """Median wall time of `carry = step(carry)` after `warmup` untimed calls."""
  times = []
  for i in range(warmup + reps):
    start = time.perf_counter()
    carry = jax.block_until_ready(step(carry))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return statistics.median(times), carry


def _scalars(count: int = 10) -> kernels.AdamWScalars:
  bc1, bc2 = jax.jit(lambda c: (1 - 0.9**c, 1 - 0.999**c))(jnp.int32(count))
  return kernels.AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                              weight_decay=0.1, bc1=bc1, bc2=bc2)


def _state(size: int, rng: np.random.Generator):
  master = jnp.asarray(rng.standard_normal(size, dtype=np.float32))
  mu = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-3)
  nu = jnp.asarray(rng.random(size, dtype=np.float32) * 1e-6)
  return master, mu, nu


# ----------------------------------------------------------------------------- CPU


def numpy_probes(size: int, threads: int, reps: int) -> list[Row]:
  """Streaming bandwidth with `threads` numpy workers (numpy frees the GIL)."""
  a = np.ones(size, np.float32)
  b = np.ones(size, np.float32)
  chunks = np.array_split(np.arange(size), threads)
  bounds = [(c[0], c[-1] + 1) for c in chunks]
  pool = concurrent.futures.ThreadPoolExecutor(threads)

  def run(fn):
    list(pool.map(lambda ab: fn(*ab), bounds))

  copy = lambda lo, hi: np.copyto(b[lo:hi], a[lo:hi])
  scale = lambda lo, hi: np.multiply(a[lo:hi], np.float32(1.0000001), out=a[lo:hi])
  rows = []
  for name, fn, nbytes in (('copy', copy, 8), ('in-place scale', scale, 8)):
    seconds, _ = _median(lambda _: run(fn), None, reps)
    rows.append(Row(f'numpy {name}, {threads} thread(s), 4 KiB pages', seconds, size, nbytes))
  pool.shutdown()
  return rows


def native_probe(size: int, threads: int, reps: int) -> Row:
  """The AdamW memory traffic (28 B/param) with no arithmetic: the bound for any AdamW."""
  from dos_jax.kernels import _host_adamw  # pylint: disable=g-import-not-at-top
  seconds = _host_adamw.probe_seconds(size, threads, reps)
  return Row(f'native p, m, v += g in place (AdamW traffic), {threads} thread(s), '
             'huge pages', seconds, size, BYTES_PER_PARAM)


def xla_probes(size: int, reps: int) -> list[Row]:
  """Streaming bandwidth of XLA:CPU (all its threads), in place on donated buffers."""
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.random(size, dtype=np.float32))
  b = jnp.asarray(rng.random(size, dtype=np.float32))
  scale = jax.jit(lambda a: a * np.float32(1.0000001), donate_argnums=0)
  triad = jax.jit(lambda a, b: a + np.float32(1e-7) * b, donate_argnums=0)
  # The same traffic as an AdamW step without its arithmetic: read p, m, v, g and write
  # p, m, v in place (28 B/param): the tightest bound of the three.
  same_traffic = jax.jit(lambda s, g: tuple(x + g for x in s), donate_argnums=0)
  rows = []
  seconds, _ = _median(lambda s: same_traffic(s, b), _state(size, rng), reps)
  rows.append(Row('XLA p, m, v += g in place (AdamW traffic)', seconds, size, BYTES_PER_PARAM))
  seconds, a = _median(scale, a, reps)
  rows.append(Row('XLA in-place scale a *= s', seconds, size, 8))
  seconds, _ = _median(lambda a: triad(a, b), a, reps)
  rows.append(Row('XLA in-place triad a += s * b', seconds, size, 12))
  return rows


def host_kernel(size: int, threads: int, grad_dtype, lowp_dtype, reps: int) -> Row:
  rng = np.random.default_rng(0)
  grad = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2, grad_dtype)
  lowp = None if lowp_dtype is None else jnp.zeros(size, lowp_dtype)
  scalars = _scalars()

  def update(state, grad):
    master, mu, nu, lowp = state
    return kernels.adamw_host(master, mu, nu, grad, scalars, decay_limit=size // 2,
                              lowp_dtype=lowp_dtype, num_threads=threads, lowp_out=lowp)
  update = jax.jit(update, donate_argnums=0)
  seconds, _ = _median(lambda s: update(s, grad), (*_state(size, rng), lowp), reps)
  lowp_name = 'no 16-bit copy' if lowp_dtype is None else f'{jnp.dtype(lowp_dtype).name} copy'
  return Row(f'host AdamW, {threads} thread(s), {jnp.dtype(grad_dtype).name} grads, '
             f'{lowp_name}', seconds, size, BYTES_PER_PARAM)


def optax_jit(size: int, grad_dtype, lowp_dtype, reps: int) -> Row:
  """jax.jit(optax.adamw) update + apply, donated, on the default backend."""
  rng = np.random.default_rng(0)
  grad = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2, grad_dtype)
  opt = optax.adamw(1e-3, weight_decay=0.1)

  def update(carry, grad):
    params, state, _ = carry  # the last 16-bit copy is dead: XLA reuses its buffer
    updates, state = opt.update(grad.astype(jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
    return params, state, None if lowp_dtype is None else params.astype(lowp_dtype)
  update = jax.jit(update, donate_argnums=0)
  master = _state(size, rng)[0]
  lowp = None if lowp_dtype is None else jnp.zeros(size, lowp_dtype)
  seconds, _ = _median(lambda c: update(c, grad), (master, opt.init(master), lowp), reps)
  lowp_name = 'no 16-bit copy' if lowp_dtype is None else f'{jnp.dtype(lowp_dtype).name} copy'
  return Row(f'jit(optax.adamw), XLA:{jax.default_backend().upper()}, '
             f'{jnp.dtype(grad_dtype).name} grads, {lowp_name}', seconds, size,
             BYTES_PER_PARAM)


def deepspeed_cpu_adam(size: int, reps: int) -> Row | None:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  param = torch.nn.Parameter(torch.randn(size))
  param.grad = torch.randn(size) * 1e-2
  opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.1, adamw_mode=True)
  seconds, _ = _median(lambda _: opt.step(), None, reps)
  return Row(f'DeepSpeedCPUAdam, {torch.get_num_threads()} thread(s), fp32', seconds, size,
             BYTES_PER_PARAM)


def cpu_rows(size: int, reps: int) -> list[Row]:
  rows = [native_probe(size, t, reps) for t in (1, 2)]
  rows += numpy_probes(size, 1, reps) + numpy_probes(size, 2, reps) + xla_probes(size, reps)
  for grad_dtype, lowp_dtype in ((jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)):
    for threads in (1, 2):
      rows.append(host_kernel(size, threads, grad_dtype, lowp_dtype, reps))
    rows.append(optax_jit(size, grad_dtype, lowp_dtype, reps))
  deepspeed = deepspeed_cpu_adam(size, reps)
  if deepspeed is not None:
    rows.append(deepspeed)
  return rows


# ----------------------------------------------------------------------------- GPU


def gpu_rows(sizes: list[int], reps: int) -> list[Row]:
  rows = []
  for size in sizes:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random(size, dtype=np.float32))
    seconds, _ = _median(jax.jit(lambda x: x + 1), x, reps)  # reads and writes 4 B each
    rows.append(Row(f'device copy (x + 1), {size >> 20}M f32', seconds, size, 8))
    del x
    grad = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2)
    scalars = _scalars()

    def update(state, grad):
      return kernels.adamw_pallas(*state, grad, scalars, decay_limit=size // 2,
                                  lowp_dtype=None)[:3]
    update = jax.jit(update, donate_argnums=0)
    seconds, _ = _median(lambda s: update(s, grad), _state(size, rng), reps)
    rows.append(Row(f'Pallas AdamW, {size >> 20}M, fp32 grads', seconds, size,
                    BYTES_PER_PARAM))
    del grad
    rows.append(optax_jit(size, jnp.float32, None, reps))
  return rows


# ----------------------------------------------------------------------------- report


def table(rows: list[Row]) -> str:
  lines = ['| what | params / elements | median ms | GB/s | Gparam/s (or bound at 28 B/param) |',
           '|---|---|---|---|---|']
  for r in rows:
    bound = r.gbytes / BYTES_PER_PARAM
    is_adamw = r.bytes_per_elem == BYTES_PER_PARAM and 'AdamW traffic' not in r.what
    gp = f'{r.gparams:.3f}' if is_adamw else f'(<= {bound:.3f})'
    lines.append(f'| {r.what} | {r.size / 2**20:.0f}M | {r.seconds * 1e3:.1f} | '
                 f'{r.gbytes:.1f} | {gp} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', type=int, default=64 << 20, help='CPU parameters')
  parser.add_argument('--reps', type=int, default=7, help='timed repetitions (median)')
  parser.add_argument('--gpu-sizes', type=str, default='16,64,256',
                      help='GPU parameter counts in Mi, comma separated')
  parser.add_argument('--out', type=str, default=None, help='also write a markdown table')
  args = parser.parse_args()

  if not kernels.host_kernel_available():
    raise SystemExit(f'host kernel missing: {kernels.host_kernel_unavailable_reason()}')
  header = (f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, '
            f'{platform.processor() or platform.machine()}, '
            f'{kernels.default_num_threads()} cores available, jax {jax.__version__}, '
            f'host ISA {max(kernels.supported_isas()).name}')
  print(header)
  report = ['## CPU', '', table(cpu_rows(args.size, args.reps))]
  print('\n'.join(report))
  if jax.default_backend() == 'gpu':
    sizes = [int(s) << 20 for s in args.gpu_sizes.split(',')]
    gpu = ['', f'## GPU: {jax.devices()[0].device_kind}', '', table(gpu_rows(sizes, args.reps))]
    print('\n'.join(gpu))
    report += gpu
  if args.out:
    with open(args.out, 'w') as f:
      f.write(header + '\n\n' + '\n'.join(report) + '\n')


if __name__ == '__main__':
  main()
