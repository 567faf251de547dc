"""Update time of the row-wise native host AdamW against jit(optax.adamw), one process.

Times, on `--params` elements split into subgroups of `--subgroup-size`:
  * `jax.jit(optax.adamw)` update + apply_updates on one fp32 leaf (params and state
    donated): the baseline;
  * `adamw_host_rows` over every subgroup of a donated (G, K, S) state, with a master
    (16-bit params: f32 master, mu, nu; bf16 gradients and bf16 out rows) and without
    (fp32 params: mu, nu; f32 gradients, params and update rows).
(A row of the flat host kernel, `adamw_host`, was measured beside these until that
kernel left the library: notes/results_kernels2.md.)
Each is the median of `--reps` runs after one warm-up.

  python experiments/bench_host_rows.py --params 50_000_000 --subgroup-size 10_000_000
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dos_jax import kernels
from dos_jax.kernels.host_adamw_rows import adamw_host_rows


def median_time(fn, carry, consts, reps: int) -> float:
  carry = fn(*carry, *consts)
  jax.block_until_ready(carry)
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    carry = fn(*carry, *consts)
    jax.block_until_ready(carry)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=50_000_000)
  parser.add_argument('--subgroup-size', type=int, default=10_000_000)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--threads', type=int, default=None)
  args = parser.parse_args(argv)
  groups = -(-args.params // args.subgroup_size)
  size = args.subgroup_size
  n = groups * size
  rng = np.random.default_rng(0)
  grad32 = jnp.asarray(rng.standard_normal(n, np.float32) * 1e-2)
  param32 = jnp.asarray(rng.standard_normal(n, np.float32))
  scalars = kernels.AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                                 weight_decay=1e-4, bc1=0.1, bc2=0.001)
  rows = jnp.arange(groups, dtype=jnp.int32)
  print(f'{n / 1e6:.0f}M elements in {groups} subgroups of {size:,}, '
        f'{jax.default_backend()}, jax {jax.__version__}, threads {args.threads or "all"}')

  opt = optax.adamw(1e-3, weight_decay=1e-4)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def optax_step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = param32 + 0
  base = median_time(optax_step, (p, opt.init(p)), (grad32,), args.reps)
  print(f'{"jit(optax.adamw) fp32":<40} {base * 1e3:8.1f} ms  {n / base / 1e9:5.2f} Gparam/s')

  def row_step(lowp, slots, stacked, out, grads, params):
    return adamw_host_rows(stacked, grads, params, rows, scalars, slots=slots,
                           decayed_rows=groups, lowp_dtype=lowp, out=out, indexed=True,
                           num_threads=args.threads)

  cases = (
      ('rows, master, bf16 grads + out', jnp.bfloat16, (0, 1, 2),
       grad32.reshape(groups, size).astype(jnp.bfloat16), None),
      ('rows, no master, fp32 grads + params', jnp.float32, (-1, 0, 1),
       grad32.reshape(groups, size), param32.reshape(groups, size)),
  )
  for name, lowp, slots, grads, params in cases:
    k = 3 if slots[0] >= 0 else 2
    stacked = jnp.zeros((groups, k, size), jnp.float32)
    fn = jax.jit(functools.partial(row_step, lowp, slots), donate_argnums=(0, 1))
    t = median_time(fn, (stacked, jnp.zeros((groups, size), lowp)), (grads, params), args.reps)
    print(f'{name:<40} {t * 1e3:8.1f} ms  {n / t / 1e9:5.2f} Gparam/s  {t / base:.2f}x')

if __name__ == '__main__':
  main()
