"""Update-phase time of dos_jax.adamw per placement policy, against jit(optax.adamw).

One jitted, donated step (update + apply_updates) on a synthetic state of `--params`
elements, timed as the median of `--reps` runs after a warm-up, in one process so the
ratio to optax is measured on the same machine at the same moment.

  python experiments/bench_update.py --params 100_000_000 --subgroup-size 10_000_000

On a CPU-only machine every "device" is the CPU, so the policies differ only in the
loop structure and memory kinds; only a GPU can rank them (see RESULTS.md).

`--mesh 2x2` runs on a (data, tensor) mesh of that many (virtual, on CPU) devices with
the state sharded over `data` (ZeRO-1); params are replicated, optax likewise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax


def synthetic(num_params: int, dtype):
  """Params and gradients of `num_params` elements in two leaves whose sizes are not
  multiples of any subgroup size, so that packing does real work."""
  sizes = (num_params * 3 // 4 + 7, num_params // 4 - 7)
  keys = jax.random.split(jax.random.key(0), 4)
  params = {f'w{i}': jax.random.normal(k, (n,), dtype) for i, (k, n) in enumerate(zip(keys, sizes))}
  grads = {f'w{i}': jax.random.normal(k, (n,), dtype) * 1e-2
           for i, (k, n) in enumerate(zip(keys[2:], sizes))}
  return params, grads


def time_step(opt, params, grads, reps: int, plan=None) -> float:
  state = opt.init(params)
  kwargs = {} if plan is None else {'plan': plan}

  def step(p, s, g):
    u, s = opt.update(g, s, p, **kwargs)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  p = jax.tree.map(jnp.copy, params)
  p, state = step(p, state, grads)
  jax.block_until_ready((p, state))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    p, state = step(p, state, grads)
    jax.block_until_ready((p, state))
    times.append(time.perf_counter() - start)
  del p, state
  return statistics.median(times)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=100_000_000)
  parser.add_argument('--subgroup-size', type=int, default=10_000_000)
  parser.add_argument('--dtype', choices=['float32', 'bfloat16'], default='float32')
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--impl', choices=[i.value for i in dos_jax.UpdateImpl], default='kernel')
  parser.add_argument('--mesh', default=None,
                      help="DATAxTENSOR, e.g. 2x2: shard the state over a 'data' axis")
  args = parser.parse_args(argv)

  mesh = None
  if args.mesh:
    data, tensor = (int(n) for n in args.mesh.lower().split('x'))
    if jax.default_backend() == 'cpu' and len(jax.devices()) < data * tensor:
      raise SystemExit(f'--mesh {args.mesh} needs {data * tensor} devices: run with '
                       f'XLA_FLAGS=--xla_force_host_platform_device_count={data * tensor}')
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:data * tensor]).reshape(data, tensor), ('data', 'tensor'))
  params, grads = synthetic(args.params, jnp.dtype(args.dtype))
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params, grads = jax.device_put((params, grads), replicated)

  print(f'{args.params / 1e6:.0f}M {args.dtype} params, subgroup {args.subgroup_size:,},'
        f' {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}'
        + ('' if mesh is None else f', mesh {dict(mesh.shape)}'))
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  # The baseline: optax.adamw on fp32 params (with bf16 params it would keep bf16 state).
  baseline = time_step(optax.adamw(1e-3), master, grads, args.reps)
  print(f'{"jit(optax.adamw)":<24} {baseline * 1e3:9.1f} ms   1.00x')
  impl = dos_jax.UpdateImpl(args.impl)
  for policy in (dos_jax.AllHost(), dos_jax.Stride(2), dos_jax.DeviceFraction(0.25),
                 dos_jax.AllDevice()):
    offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=policy,
                              device_impl=impl, host_impl=impl, mesh=mesh)
    seconds = time_step(dos_jax.adamw(1e-3, offload=offload), params, grads, args.reps)
    print(f'{repr(policy):<24} {seconds * 1e3:9.1f} ms   {seconds / baseline:.2f}x')


if __name__ == '__main__':
  main()
