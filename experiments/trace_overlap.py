"""How long host-update and device-update work overlapped in one profiled step.

Takes a `jax.profiler` trace of one Stride(2) update step (synthetic bf16 params) and
reads the Chrome-trace file it writes (`plugins/profile/*/*.trace.json.gz`): the union
of the device kernel events (the Pallas AdamW), the union of the host-update events
(the native host AdamW or XLA's host-execute work), and the length of their
intersection. Nobody has seen a real GPU trace of this program yet, so the event-name
patterns are arguments.

  python experiments/trace_overlap.py --params 1_000_000_000 --out $OUT
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import tempfile


def union(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def length(intervals) -> float:
  return sum(end - start for start, end in intervals)


def intersect(a, b):
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      out.append([start, end])
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def overlap(trace: dict, device_pattern: str, host_pattern: str) -> dict[str, float]:
  """Milliseconds of device work, host work and their overlap in a Chrome trace."""
  dev, host = [], []
  for event in trace.get('traceEvents', []):
    if event.get('ph') != 'X' or 'dur' not in event:
      continue
    span = (float(event['ts']), float(event['ts']) + float(event['dur']))
    name = event.get('name', '')
    if re.search(device_pattern, name):
      dev.append(span)
    elif re.search(host_pattern, name):
      host.append(span)
  dev, host = union(dev), union(host)
  return {'device_ms': length(dev) / 1e3, 'host_ms': length(host) / 1e3,
          'overlap_ms': length(intersect(dev, host)) / 1e3}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=1_000_000_000)
  parser.add_argument('--subgroup-size', type=int, default=100_000_000)
  parser.add_argument('--device-pattern', default=r'dos_jax_adamw(?!_host)|triton')
  parser.add_argument('--host-pattern', default=r'dos_jax_adamw_host|HostExecute|host')
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import dos_jax  # pylint: disable=import-outside-toplevel
  from experiments.bench_update import synthetic  # pylint: disable=import-outside-toplevel

  params, grads = synthetic(args.params, jnp.bfloat16)
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=args.subgroup_size,
                                                    policy=dos_jax.Stride(2)))
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  params, state = jax.block_until_ready(step(params, state, grads))
  directory = args.out or tempfile.mkdtemp()
  trace_dir = os.path.join(directory, 'trace')
  with jax.profiler.trace(trace_dir):
    params, state = jax.block_until_ready(step(params, state, grads))
  files = glob.glob(os.path.join(trace_dir, 'plugins/profile/*/*.trace.json.gz'))
  if not files:
    raise SystemExit(f'no Chrome trace under {trace_dir}')
  with gzip.open(files[0]) as f:
    result = overlap(json.load(f), args.device_pattern, args.host_pattern)
  share = result['overlap_ms'] / max(1e-9, min(result['device_ms'], result['host_ms']))
  print(f"host {result['host_ms']:.1f} ms, device {result['device_ms']:.1f} ms, overlap "
        f"{result['overlap_ms']:.1f} ms ({100 * share:.0f}% of the shorter)")


if __name__ == '__main__':
  main()
