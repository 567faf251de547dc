"""Throughput of the AdamW kernels against jitted optax and a memory-bandwidth probe.

CPU (always): the native host AdamW at 1 and 2 threads (the library's row-wise kernel on
one subgroup), `jax.jit(optax.adamw)` (update + apply, donated), DeepSpeedCPUAdam when
`deepspeed` is importable, and numpy and XLA streaming probes that bound what any AdamW
can do: an update reads and writes master, m, v and reads the gradient, 28 bytes per
parameter with fp32 gradients and no 16-bit copy (or bf16 gradients plus a bf16 copy),
so Gparam/s <= probe GB/s / 28.
GPU (only where JAX sees one): the flat Pallas AdamW (pallas_adamw_flat.py; bf16
gradients and a bf16 copy, as the device path runs it, and fp32 gradients without a
copy) against two jitted device copies of the same byte count (`x + 1` and `jnp.copy`
on an f32 buffer of 3.5 elements per parameter: 28 bytes read and written per
parameter, like the AdamW) and against `jax.jit(optax.adamw)` (update + apply + the
16-bit copy, donated) at the same sizes (default 16M and 256M). The bandwidth goal is
85% of the copy's.

  python experiments/bench_kernels.py                      # 64M params, prints a table
  python experiments/bench_kernels.py --out experiments/notes/results_kernels.md
  python experiments/bench_kernels.py --gpu-only --gpu-sizes 16,256 --json $OUT/pallas.json
  python experiments/bench_kernels.py --gpu-only --interpret --gpu-sizes 1   # smoke test, CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dos_jax import kernels
import pallas_adamw_flat  # experiments/ is the script's own directory

BYTES_PER_PARAM = 28  # read p, m, v, g (16) + write p, m, v (12), fp32 everywhere


@dataclasses.dataclass(frozen=True)
class Row:
  what: str
  seconds: float  # median of the timed repetitions
  size: int  # parameters (or f32 elements for probes)
  bytes_per_elem: int
  probe: bool = False  # a bound (copy, bandwidth probe), not an AdamW

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
  probe: bool = False


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
  """Memory-bandwidth probes: bounds on what any AdamW can reach here.

  (The native AdamW-traffic probe, `p, m, v += g` threaded like the kernel, was part of
  the flat host kernel's library and went with it; notes/results_kernels*.md show its rows.)
  """
  cases = []
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
  """The native host AdamW (`adamw_host_rows` on one subgroup: a `(1, 3, size)` state of
  master, mu and nu, decayed); all variants update one shared, donated state. Without a
  16-bit copy the out row is an f32 copy of the master (4 B/param more than counted)."""
  rng = np.random.default_rng(0)
  grads = {d: jnp.asarray(rng.standard_normal((1, size), dtype=np.float32) * 1e-2, d)
           for d in (jnp.float32, jnp.bfloat16)}
  state = Carry((jnp.stack(_state(size, rng))[None], jnp.zeros((1, size), jnp.bfloat16)))
  scalars = _scalars()
  row = jnp.zeros(1, jnp.int32)

  @functools.partial(jax.jit, static_argnames=('threads', 'lowp_dtype'),
                     donate_argnums=0)
  def update(state, grad, *, threads, lowp_dtype):
    stacked, lowp = state
    reuse = lowp_dtype == jnp.bfloat16  # the dead copy is the out buffer
    stacked, out = kernels.adamw_host_rows(
        stacked, grad, None, row, scalars, slots=(0, 1, 2), decayed_rows=1,
        lowp_dtype=lowp_dtype or jnp.float32, num_threads=threads,
        out=lowp if reuse else None)
    return stacked, out if reuse else lowp

  cases = []
  for grad_dtype, lowp_dtype in ((jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)):
    for threads in (1, 2):
      step = functools.partial(update, grad=grads[grad_dtype], threads=threads,
                               lowp_dtype=lowp_dtype)
      cases.append(Case(f'host AdamW, {threads} thread(s), {jnp.dtype(grad_dtype).name} '
                        f'grads, {_lowp_name(lowp_dtype)}', BYTES_PER_PARAM,
                        functools.partial(state.timed, step)))
  return cases


def optax_cases(size: int, variants=((jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)),
                on_device: bool = False):
  """jax.jit(optax.adamw) update + apply (+ the 16-bit copy), donated. `on_device`: make
  the inputs with jax.random where they live (numpy takes seconds at 256M)."""
  rng = np.random.default_rng(2)
  opt = optax.adamw(1e-3, weight_decay=0.1)
  master = _device_arrays(size, 2)[0] if on_device else _state(size, rng)[0]
  carry = Carry((master, opt.init(master), jnp.zeros(size, jnp.bfloat16)))

  @functools.partial(jax.jit, static_argnames='lowp_dtype', donate_argnums=0)
  def update(carry, grad, *, lowp_dtype):
    params, state, lowp = carry  # the last 16-bit copy is dead: XLA reuses its buffer
    updates, state = opt.update(grad.astype(jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
    return params, state, lowp if lowp_dtype is None else params.astype(lowp_dtype)

  cases = []
  for grad_dtype, lowp_dtype in variants:
    if on_device:
      grad = _device_arrays(size, 3)[3].astype(grad_dtype)
    else:
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
  return [Row(c.what, statistics.median(t), size, c.bytes_per_elem, c.probe)
          for c, t in zip(cases, times)]


def cpu_rows(size: int, reps: int) -> list[Row]:
  cases = probe_cases(size) + host_cases(size) + optax_cases(size) + deepspeed_cases(size)
  return measure(cases, size, reps)


# ----------------------------------------------------------------------------- GPU


def _device_arrays(size: int, seed: int):
  """master, mu, nu and an f32 gradient made by jax.random on the default device."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (size,), jnp.float32),
          jax.random.normal(keys[1], (size,), jnp.float32) * 1e-3,
          jax.random.uniform(keys[2], (size,), jnp.float32) * 1e-6,
          jax.random.normal(keys[3], (size,), jnp.float32) * 1e-2)


PALLAS_BF16 = 'Pallas AdamW, bf16 grads, bf16 copy'
PALLAS_F32 = 'Pallas AdamW, fp32 grads, no 16-bit copy'
COPY_ADD = 'device copy: jit(x + 1), same bytes'
COPY_COPY = 'device copy: jit(jnp.copy), same bytes'


def gpu_cases(size: int, interpret: bool = False) -> list[Case]:
  """The Pallas AdamW, two device copies moving its bytes, and jitted optax at `size`.

  Bytes per parameter (28 in both Pallas variants): read master, mu, nu (12) and the
  gradient (2 bf16 or 4 f32); write master, mu, nu (12) and the bf16 copy (2, or none).
  The copies read and write an f32 buffer of size * 28 / 8 elements: the same 28 bytes.
  """
  master, mu, nu, grad32 = _device_arrays(size, 0)
  grads = {None: grad32, jnp.bfloat16: grad32.astype(jnp.bfloat16)}
  state = Carry((master, mu, nu, jnp.zeros(size, jnp.bfloat16)))
  scalars = _scalars()

  @functools.partial(jax.jit, static_argnames='lowp_dtype', donate_argnums=0)
  def update(state, grad, *, lowp_dtype):
    master, mu, nu, lowp = state
    master, mu, nu, new_lowp = pallas_adamw_flat.adamw_pallas(
        master, mu, nu, grad, scalars, decay_limit=size // 2, lowp_dtype=lowp_dtype,
        lowp_out=None if lowp_dtype is None else lowp, interpret=interpret)
    return master, mu, nu, lowp if new_lowp is None else new_lowp

  buffer = jax.random.uniform(jax.random.key(9), (size * BYTES_PER_PARAM // 8,), jnp.float32)
  add_one, copy = jax.jit(lambda x: x + 1), jax.jit(jnp.copy)  # no donation: new buffers
  cases = [
      Case(COPY_ADD, BYTES_PER_PARAM, lambda: _timed(lambda: add_one(buffer)), probe=True),
      Case(COPY_COPY, BYTES_PER_PARAM, lambda: _timed(lambda: copy(buffer)), probe=True),
  ]
  for lowp_dtype, what in ((jnp.bfloat16, PALLAS_BF16), (None, PALLAS_F32)):
    step = functools.partial(update, grad=grads[lowp_dtype], lowp_dtype=lowp_dtype)
    cases.append(Case(what, BYTES_PER_PARAM, functools.partial(state.timed, step)))
  return cases + optax_cases(size, variants=((jnp.bfloat16, jnp.bfloat16), (jnp.float32, None)),
                             on_device=True)


def gpu_rows(sizes: list[int], reps: int, interpret: bool = False) -> list[Row]:
  rows = []
  for size in sizes:
    rows += measure(gpu_cases(size, interpret), size, reps)
  return rows


def gpu_summary(rows: list[Row]) -> list[str]:
  """Per size: the Pallas AdamW's bandwidth as a share of the copies', and vs optax with
  the same gradient and copy dtypes. The bf16 line of the largest size comes last."""
  lines = []
  for size in sorted({r.size for r in rows}):
    at = {r.what: r for r in rows if r.size == size}
    best_copy = max(at[COPY_ADD].gbytes, at[COPY_COPY].gbytes)
    for what, dtypes in ((PALLAS_F32, 'float32 grads, no 16-bit copy'),
                         (PALLAS_BF16, 'bfloat16 grads, bfloat16 copy')):
      pallas = at[what]
      reference = next((r for w, r in at.items() if 'optax' in w and w.endswith(dtypes)), None)
      lines.append(
          f'{size / 2**20:g}M {what}: {pallas.gbytes:.0f} GB/s = '
          f'{100 * pallas.gbytes / best_copy:.0f}% of the faster copy '
          f'(x + 1 {at[COPY_ADD].gbytes:.0f} GB/s, jnp.copy {at[COPY_COPY].gbytes:.0f} GB/s)'
          + ('' if reference is None else
             f', {pallas.seconds / reference.seconds:.2f}x the time of jit(optax.adamw)'))
  return lines


# ----------------------------------------------------------------------------- report


def table(rows: list[Row]) -> str:
  lines = ['| what | params / elements | median ms | GB/s | Gparam/s (or bound at 28 B/param) |',
           '|---|---|---|---|---|']
  for r in rows:
    bound = r.gbytes / BYTES_PER_PARAM
    is_adamw = (not r.probe and r.bytes_per_elem == BYTES_PER_PARAM
                and 'AdamW traffic' not in r.what)
    gp = f'{r.gparams:.3f}' if is_adamw else f'(<= {bound:.3f})'
    lines.append(f'| {r.what} | {r.size / 2**20:g}M | {r.seconds * 1e3:.1f} | '
                 f'{r.gbytes:.1f} | {gp} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', type=int, default=64 << 20, help='CPU parameters')
  parser.add_argument('--reps', type=int, default=7, help='timed repetitions (median)')
  parser.add_argument('--gpu-sizes', type=str, default='16,256',
                      help='GPU parameter counts in Mi, comma separated')
  parser.add_argument('--gpu-only', action='store_true',
                      help='skip the CPU section (and its need for the native kernel)')
  parser.add_argument('--interpret', action='store_true',
                      help='run the GPU section without a GPU, Pallas in interpret mode '
                      '(a smoke test: its numbers mean nothing)')
  parser.add_argument('--out', type=str, default=None, help='also write a markdown table')
  parser.add_argument('--json', type=str, default=None, help='also write the rows as JSON')
  args = parser.parse_args()

  on_gpu = jax.default_backend() == 'gpu'
  if args.gpu_only and not (on_gpu or args.interpret):
    raise SystemExit(f'--gpu-only: no GPU here ({jax.default_backend()}); add --interpret '
                     'for a smoke test')
  if not args.gpu_only and not kernels.rows_kernel_available():
    raise SystemExit('host kernel missing: '
                     f'{kernels.host_adamw_rows.rows_kernel_unavailable_reason()}')
  header = (f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, '
            f'{platform.processor() or platform.machine()}, '
            f'{kernels.default_num_threads()} cores available, jax {jax.__version__}'
            + (f', host ISA {max(kernels.supported_isas()).name}'
               if kernels.rows_kernel_available() else ''))
  print(header)
  report, rows = [], {}
  if not args.gpu_only:
    rows['cpu'] = cpu_rows(args.size, args.reps)
    report += ['## CPU', '', table(rows['cpu'])]
    print('\n'.join(report))
  if on_gpu or args.interpret:
    sizes = [int(float(s) * 2**20) for s in args.gpu_sizes.split(',')]
    rows['gpu'] = gpu_rows(sizes, args.reps, interpret=not on_gpu)
    summary = gpu_summary(rows['gpu'])
    kind = jax.devices()[0].device_kind + ('' if on_gpu else ', Pallas in interpret mode')
    gpu = ['', f'## GPU: {kind}', '', table(rows['gpu']), ''] + summary
    print('\n'.join(gpu))
    report += gpu
    print(f'SUMMARY {summary[-1]}')
  if args.out:
    with open(args.out, 'w') as f:
      f.write(header + '\n\n' + '\n'.join(report) + '\n')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'header': header, 'backend': jax.default_backend(),
                 **{k: [dict(dataclasses.asdict(r), gbytes_per_s=r.gbytes) for r in v]
                    for k, v in rows.items()}}, f, indent=1)


if __name__ == '__main__':
  main()
