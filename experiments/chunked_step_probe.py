"""A prototype of the chunked step: K host chunks and K device parts, linked.

A bf16 MLP (`--layers`, 1024 wide) whose odd layers' state is updated on the host and
even layers' state streamed through the device (a stand-in update, no Pallas), in K
chunks. Chunk k: the host call takes the link token of chunk k-1 (so every one of its
instructions depends on it) and its gradients in host memory; the device part is let
through an optimization barrier with exactly those inputs; the next token is made on
the device from a token of every host output (returned in device memory) and one of
every device output, times a runtime value. So host chunk k+1 and device part k+1 both
come after both halves of chunk k. Compiled for an H100 (no GPU), it prints each host
call's window and the device work issued inside it.

  JAX_PLATFORMS=cpu python3.12 experiments/chunked_step_probe.py --chunks 4 --layers 16
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--chunks', type=int, default=2)
  parser.add_argument('--layers', type=int, default=8)
  args = parser.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from dos_jax import dataflow
  from dos_jax import memory_spaces

  chunks, num_layers, width = args.chunks, args.layers, 1024
  rng = np.random.default_rng(0)
  params = {f'l{i}': jnp.asarray(rng.standard_normal((width, width)) / 32, jnp.bfloat16)
            for i in range(num_layers)}
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  host_layers, device_layers = list(range(1, num_layers, 2)), list(range(0, num_layers, 2))
  rows = lambda n: [jax.device_put(jnp.zeros((3, width * width), jnp.float32), host)
                    for _ in range(n)]
  host_state, streamed_state = rows(len(host_layers)), rows(len(device_layers))
  x = jnp.asarray(rng.standard_normal((256, width)), jnp.bfloat16)

  def loss(p, x):
    h = x
    for i in range(num_layers):
      h = jnp.tanh(h @ p[f'l{i}'])
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def step(p, host_state, streamed_state, x):
    g = jax.grad(loss)(p, x)
    g_host = [memory_spaces.to_host(g[f'l{i}'].reshape(-1)) for i in host_layers]
    g_dev = [g[f'l{i}'].reshape(-1) for i in device_layers]
    runtime = x[0, 0].astype(jnp.float32)
    token = memory_spaces.to_host(jnp.zeros((1,), jnp.float32))
    new_host, new_dev = {}, {}
    for hc, dc in zip(np.array_split(np.arange(len(host_layers))[::-1], chunks),
                      np.array_split(np.arange(len(device_layers)), chunks)):
      inputs = (token, tuple(host_state[int(r)] for r in hc), tuple(g_host[int(r)] for r in hc))
      inputs, grads = lax.optimization_barrier((inputs, [g_dev[int(r)] for r in dc]))

      def update(tok, state, grads):
        out = tuple(s * 0.9 + gr.astype(jnp.float32)[None] + tok[0]
                    for s, gr in zip(state, grads))
        return sum(o[0, :1] for o in out) * 0 + tok, out

      host_token, host_out = memory_spaces.host_region(
          update, out_spaces=(memory_spaces.DEVICE, memory_spaces.HOST))(*inputs)
      dev_out = []
      for r, gr in zip(dc, grads):
        block = jax.device_put(streamed_state[int(r)], memory_spaces.DEVICE)
        block = lax.optimization_barrier(block * 0.9 + gr.astype(jnp.float32)[None] * jnp.tanh(block))
        dev_out.append(memory_spaces.to_host(block))
      new_host.update({int(r): o for r, o in zip(hc, host_out)})
      new_dev.update({int(r): o for r, o in zip(dc, dev_out)})
      dev_token = sum(jax.device_put(o[0, :1], memory_spaces.DEVICE) for o in dev_out) * 0
      token = memory_spaces.to_host(host_token * runtime + dev_token)
    return ([new_host[i] for i in range(len(host_layers))],
            [new_dev[i] for i in range(len(device_layers))])

  schedule = dataflow.compile_for_gpu(step, params, host_state, streamed_state, x).schedule
  last_gemm = max(schedule.gemm_positions)
  print(f'{chunks} chunks, {num_layers} layers: last backward gemm at {last_gemm}')
  for call in schedule.host_calls:
    print(f'  host call {call.start}-{call.done}: device work inside {list(call.device_between)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
