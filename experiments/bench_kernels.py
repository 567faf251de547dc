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
import functools
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


@dataclasses.dataclass
class Case:
  """One thing to time: `run()` makes one call and returns its wall seconds."""

  what: str
  bytes_per_elem: int
  run: Callable[[], float]


class Carry:
  """A value threaded through donated calls, shared by the cases that update it."""

  def __init__(self, value):
    self.value = value

  def timed(self, step: Callable) -> float:
    start = time.perf_counter()
    self.value = jax.block_until_ready(step(self.value))
    return time.perf_counter() - start


def _timed(fn: Callable) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def probe_cases(size: int) -> list[Case]:
  """Memory-bandwidth probes: bounds on what any AdamW can reach here."""
  from dos_jax.kernels import _host_adamw  # pylint: disable=g-import-not-at-top
  cases = [
      # The AdamW traffic (28 B/param) with no arithmetic, threaded like the kernel.
      Case(f'native p, m, v += g in place (AdamW traffic), {t} thread(s), huge pages',
           BYTES_PER_PARAM, functools.partial(_host_adamw.probe_seconds, size, t, 1))
      for t in (1, 2)
  ]
  a, b = np.ones(size, np.float32), np.ones(size, np.float32)
  for threads in (1, 2):
    pool = concurrent.futures.ThreadPoolExecutor(threads)  # numpy frees the GIL
    bounds = [(c[0], c[-1] + 1) for c in np.array_split(np.arange(size), threads)]
    copy = lambda lo, hi: np.copyto(b[lo:hi], a[lo:hi])
    scale = lambda lo, hi: np.multiply(a[lo:hi], np.float32(1.0000001), out=a[lo:hi])
    for name, fn in (('copy', copy), ('in-place scale', scale)):
      run = lambda fn=fn, pool=pool, bounds=bounds: _timed(
          lambda: list(pool.map(lambda ab: fn(*ab), bounds)))
      cases.append(Case(f'numpy {name}, {threads} thread(s), 4 KiB pages', 8, run))
  rng = np.random.default_rng(1)
  x = Carry(jnp.asarray(rng.random(size, dtype=np.float32)))
  y = jnp.asarray(rng.random(size, dtype=np.float32))
  scale = jax.jit(lambda a: a * np.float32(1.0000001), donate_argnums=0)
  triad = jax.jit(lambda a, b: a + np.float32(1e-7) * b, donate_argnums=0)
  cases.append(Case('XLA:CPU in-place scale a *= s', 8, lambda: x.timed(scale)))
  cases.append(Case('XLA:CPU in-place triad a += s * b', 12,
                    lambda: x.timed(lambda v: triad(v, y))))
  return cases


def _lowp_name(lowp_dtype) -> str:
  return 'no 16-bit copy' if lowp_dtype is None else f'{jnp.dtype(lowp_dtype).name} copy'


def host_cases(size: int) -> list[Case]:
  """The native host AdamW; all variants update one shared, donated state."""
  rng = np.random.default_rng(0)
  grads = {d: jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2, d)
           for d in (jnp.float32, jnp.bfloat16)}
  state = Carry((*_state(size, rng), jnp.zeros(size, jnp.bfloat16)))
  scalars = _scalars()

  @functools.partial(jax.jit, static_argnames=('threads', 'lowp_dtype'),
                     donate_argnums=0)
  def update(state, grad, *, threads, lowp_dtype):
    master, mu, nu, lowp = state
    master, mu, nu, new_lowp = kernels.adamw_host(
        master, mu, nu, grad, scalars, decay_limit=size // 2, lowp_dtype=lowp_dtype,
        num_threads=threads, lowp_out=None if lowp_dtype is None else lowp)
    return master, mu, nu, lowp if new_lowp is None else new_lowp

  cases = []
  for grad_dtype, lowp_dtype in ((jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)):
    for threads in (1, 2):
      step = functools.partial(update, grad=grads[grad_dtype], threads=threads,
                               lowp_dtype=lowp_dtype)
      cases.append(Case(f'host AdamW, {threads} thread(s), {jnp.dtype(grad_dtype).name} '
                        f'grads, {_lowp_name(lowp_dtype)}', BYTES_PER_PARAM,
                        functools.partial(state.timed, step)))
  return cases


def optax_cases(size: int, variants=((jnp.float32, None), (jnp.bfloat16, jnp.bfloat16))):
  """jax.jit(optax.adamw) update + apply (+ the 16-bit copy), donated."""
  rng = np.random.default_rng(2)
  opt = optax.adamw(1e-3, weight_decay=0.1)
  master = _state(size, rng)[0]
  carry = Carry((master, opt.init(master), jnp.zeros(size, jnp.bfloat16)))

  @functools.partial(jax.jit, static_argnames='lowp_dtype', donate_argnums=0)
  def update(carry, grad, *, lowp_dtype):
    params, state, lowp = carry  # the last 16-bit copy is dead: XLA reuses its buffer
    updates, state = opt.update(grad.astype(jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
    return params, state, lowp if lowp_dtype is None else params.astype(lowp_dtype)

  cases = []
  for grad_dtype, lowp_dtype in variants:
    grad = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2, grad_dtype)
    step = functools.partial(update, grad=grad, lowp_dtype=lowp_dtype)
    cases.append(Case(f'jit(optax.adamw), XLA:{jax.default_backend().upper()}, '
                      f'{jnp.dtype(grad_dtype).name} grads, {_lowp_name(lowp_dtype)}',
                      BYTES_PER_PARAM, functools.partial(carry.timed, step)))
  return cases


def deepspeed_cases(size: int) -> list[Case]:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  param = torch.nn.Parameter(torch.randn(size))
  param.grad = torch.randn(size) * 1e-2
  opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.1, adamw_mode=True)
  return [Case(f'DeepSpeedCPUAdam, {torch.get_num_threads()} thread(s), fp32',
               BYTES_PER_PARAM, lambda: _timed(opt.step))]


def measure(cases: list[Case], size: int, reps: int, warmup: int = 2) -> list[Row]:
  """Median seconds per case over `reps` rounds; each round runs every case once, so
  load from other processes on a shared machine falls on all cases alike."""
  times = [[] for _ in cases]
  for round_ in range(warmup + reps):
    for case, case_times in zip(cases, times):
      seconds = case.run()
      if round_ >= warmup:
        case_times.append(seconds)
  return [Row(c.what, statistics.median(t), size, c.bytes_per_elem)
          for c, t in zip(cases, times)]


def cpu_rows(size: int, reps: int) -> list[Row]:
  cases = probe_cases(size) + host_cases(size) + optax_cases(size) + deepspeed_cases(size)
  return measure(cases, size, reps)


# ----------------------------------------------------------------------------- GPU


def gpu_rows(sizes: list[int], reps: int) -> list[Row]:
  rows = []
  for size in sizes:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random(size, dtype=np.float32))
    copy = jax.jit(lambda x: x + 1)  # reads and writes 4 B per element
    state = Carry(_state(size, rng))
    grad = jnp.asarray(rng.standard_normal(size, dtype=np.float32) * 1e-2)
    scalars = _scalars()

    @functools.partial(jax.jit, donate_argnums=0)
    def update(state, grad):
      return kernels.adamw_pallas(*state, grad, scalars, decay_limit=size // 2,
                                  lowp_dtype=None)[:3]
    cases = [
        Case(f'device copy (x + 1), {size >> 20}M f32', 8, lambda: _timed(lambda: copy(x))),
        Case(f'Pallas AdamW, {size >> 20}M, fp32 grads, no 16-bit copy', BYTES_PER_PARAM,
             lambda: state.timed(lambda s: update(s, grad))),
    ] + optax_cases(size, variants=((jnp.float32, None),))
    rows += measure(cases, size, reps)
    del x, state, grad, cases
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
