"""The host path of dos_jax.adamw, native kernel vs XLA loop, against jit(optax.adamw).

One jitted, donated step (update + apply_updates) per configuration, timed round-robin
(one run of each in turn, `--reps` rounds, medians reported) so that load from other
processes on a shared machine hits every configuration alike.

  python experiments/bench_host_path.py --params 50_000_000 --subgroup-size 10_000_000
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import dos_jax
from bench_update import synthetic  # experiments/ is the script's own directory


class Runner:
  """A donated jitted step of `opt` and its live (params, state)."""

  def __init__(self, opt, params, grads, plan=None):
    kwargs = {} if plan is None else {'plan': plan}

    def step(p, s, g):
      u, s = opt.update(g, s, p, **kwargs)
      return optax.apply_updates(p, u), s

    self.step = jax.jit(step, donate_argnums=(0, 1))
    self.grads = grads
    self.carry = (jax.tree.map(jnp.copy, params), opt.init(params))
    self.run()
    self.temp_bytes = self.step.lower(*self.carry, grads).compile().memory_analysis(
    ).temp_size_in_bytes
    self.times = []

  def run(self) -> float:
    start = time.perf_counter()
    self.carry = self.step(*self.carry, self.grads)
    jax.block_until_ready(self.carry)
    return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=50_000_000)
  parser.add_argument('--subgroup-size', type=int, default=10_000_000)
  parser.add_argument('--dtype', choices=['float32', 'bfloat16'], default='float32')
  parser.add_argument('--reps', type=int, default=5)
  args = parser.parse_args(argv)
  params, grads = synthetic(args.params, jnp.dtype(args.dtype))
  print(f'{args.params / 1e6:.0f}M {args.dtype} params, subgroup {args.subgroup_size:,},'
        f' {jax.default_backend()}, jax {jax.__version__}, {args.reps} rounds')
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  runners = {'jit(optax.adamw) fp32': Runner(optax.adamw(1e-3), master, grads)}
  for policy in (dos_jax.AllHost(), dos_jax.Stride(2)):
    for impl in dos_jax.UpdateImpl:
      offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=policy)
      implementation = dos_jax.Implementation(host=impl, device=impl)
      runners[f'{policy!r} {impl.value}'] = Runner(
          dos_jax.adamw(1e-3, offload=offload, implementation=implementation), params, grads)
  for _ in range(args.reps):
    for runner in runners.values():
      runner.times.append(runner.run())
  base = statistics.median(runners['jit(optax.adamw) fp32'].times)
  for name, runner in runners.items():
    t = statistics.median(runner.times)
    print(f'{name:<32} {t * 1e3:8.1f} ms  {t / base:5.2f}x  temp {runner.temp_bytes / 1e6:7.1f} MB')


if __name__ == '__main__':
  main()
