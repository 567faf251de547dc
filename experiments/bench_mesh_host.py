"""The sharded two-memory program's host tier on the CPU backend: native kernel per
data shard vs XLA's host loop (issue 22, item 3).

A data x tensor mesh of virtual CPU devices, params sharded over 'tensor', the state
over 'data' (ZeRO-1); `Implementation(program='gpu')` builds the two-memory program
(host regions, pinned_host state), which the CPU backend runs. One jitted, donated step
(update + apply_updates) per configuration, timed round-robin, medians reported.
CPU timings cannot rank GPU policies (docs/design.md, "JAX facts"); they do compare two host updates of
the same program on the same cores.

  python experiments/bench_mesh_host.py --params 8_000_000 --subgroup-size 1_000_000
"""

from __future__ import annotations

import argparse
import os
import statistics

_DEVICES = 4  # set before JAX starts a backend
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count={_DEVICES}')

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding  # pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=wrong-import-position

import dos_jax  # pylint: disable=wrong-import-position
from bench_host_path import Runner  # pylint: disable=wrong-import-position


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=8_000_000)
  parser.add_argument('--subgroup-size', type=int, default=1_000_000)
  parser.add_argument('--dtype', choices=['float32', 'bfloat16'], default='bfloat16')
  parser.add_argument('--data', type=int, default=2)
  parser.add_argument('--reps', type=int, default=5)
  args = parser.parse_args(argv)
  tensor = _DEVICES // args.data
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:_DEVICES]).reshape(args.data, tensor),
                           ('data', 'tensor'))
  width = 1024
  rows = max(tensor, args.params // width // 2 // tensor * tensor)
  keys = jax.random.split(jax.random.key(0), 4)
  dtype = jnp.dtype(args.dtype)
  shapes = {'w0': (rows, width), 'w1': (width, rows)}
  specs = {'w0': P('tensor', None), 'w1': P(None, 'tensor')}
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  params = {k: jax.device_put(jax.random.normal(key, s, dtype), shardings[k])
            for (k, s), key in zip(shapes.items(), keys)}
  grads = {k: jax.device_put(jax.random.normal(key, s, dtype) * 1e-2, shardings[k])
           for (k, s), key in zip(shapes.items(), keys[2:])}
  total = sum(x.size for x in params.values())
  print(f'{total / 1e6:.1f}M {args.dtype} params, subgroup {args.subgroup_size:,}, mesh '
        f'data={args.data} x tensor={tensor}, {os.cpu_count()} cores, jax {jax.__version__},'
        f' {args.reps} rounds')
  runners = {}
  for policy in (dos_jax.AllHost(), dos_jax.Stride(2)):
    for impl in dos_jax.UpdateImpl:
      offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=policy)
      implementation = dos_jax.Implementation(
          program='gpu', host=impl,
          # XLA's device update: Pallas' interpreter would dominate.
          device=dos_jax.UpdateImpl.XLA)
      runner = Runner(dos_jax.adamw(1e-3, offload=offload, implementation=implementation),
                      params, grads)
      native = 'dos_jax_adamw_host' in runner.step.lower(*runner.carry, grads).as_text()
      runners[f'{policy!r} host {impl.value}{" (native)" if native else ""}'] = runner
  # The CPU program (one memory, `kernel_calls.sharded_update`) on the same mesh, for scale.
  runners['CPU program AllHost() kernel (native)'] = Runner(dos_jax.adamw(
      1e-3, offload=dos_jax.Offload(subgroup_size=args.subgroup_size),
      implementation=dos_jax.Implementation(program='cpu')), params, grads)
  for _ in range(args.reps):
    for runner in runners.values():
      runner.times.append(runner.run())
  for name, runner in runners.items():
    t = statistics.median(runner.times)
    print(f'{name:<44} {t * 1e3:8.1f} ms')


if __name__ == '__main__':
  main()
