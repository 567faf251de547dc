"""Do K host regions stay K host calls in the compiled GPU program? (issue 20's premise)

Starting the host update during the backward pass needs several host calls, each
started when its own gradients are on the host. This builds a bf16 MLP whose weight
gradients go to host memory per layer and are consumed by K `compute_on('device_host')`
regions (one chunk of layers each, in backward order; `--chain` makes each region also
take a value of the previous one), compiles it for an H100 with no GPU
(`dos_jax.dataflow.compile_for_gpu`, the runner's scheduler options) and reports how
many host regions the lowered program has, how many host calls the compiled one has,
and where they start relative to the backward pass's last gemm.

  JAX_PLATFORMS=cpu python3.12 experiments/host_chunks_probe.py --chunks 3 [--chain]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--chunks', type=int, default=3)
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--width', type=int, default=1024)
  parser.add_argument('--chain', action='store_true')
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from dos_jax import dataflow
  from dos_jax import paths
  from dos_jax.dataflow import hlo
  from dos_jax.dataflow import Graph
  from dos_jax.dataflow import OpKind

  rng = np.random.default_rng(0)
  num, width = args.layers, args.width
  params = {f'l{i}': jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width),
                                 jnp.bfloat16) for i in range(num)}
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  rows = jax.device_put(jnp.zeros((num, width * width), jnp.float32), host)
  x = jnp.asarray(rng.standard_normal((256, width)), jnp.bfloat16)

  def loss(p, x):
    h = x
    for i in range(num):
      h = jnp.tanh(h @ p[f'l{i}'])
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def step(p, rows, x):
    grads = jax.grad(loss)(p, x)
    on_host = [paths.to_host(grads[f'l{i}'].reshape(-1)) for i in range(num)]
    token, new = paths.to_host(jnp.zeros((1,), jnp.float32)), {}
    for chunk in np.array_split(np.arange(num)[::-1], args.chunks):
      def update(token, old, *g):
        out = tuple(r + gi.astype(jnp.float32) for r, gi in zip(old, g))
        return out[0][:1] + token, out
      last, out = paths.host_region(update)(
          token, tuple(rows[int(i)] for i in chunk), *[on_host[int(i)] for i in chunk])
      token = last if args.chain else token
      new.update({int(i): r for i, r in zip(chunk, out)})
    return jnp.stack([new[i] for i in range(num)])

  regions = len(Graph.from_lowered(dataflow.lower_for_gpu(step, params, rows, x))
                .with_kind(OpKind.HOST_REGION))
  program = dataflow.compile_for_gpu(step, params, rows, x)
  entry = hlo.Module.parse(program.hlo_text).entry_computation
  gemms = [i.position for i in entry.instructions
           if (i.attribute('kind') or '') == 'kCustom' and 'gemm' in (i.attribute('calls') or '')]
  calls = program.schedule.host_calls
  print(f'SUMMARY {args.chunks} host regions lowered ({regions} found), '
        f'{len(calls)} host call(s) compiled{" (chained)" if args.chain else ""}; '
        f'last gemm at {max(gemms)}, host calls start at {[c.start for c in calls]}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
