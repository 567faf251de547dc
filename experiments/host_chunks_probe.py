"""Do K host regions stay K host calls in the compiled GPU program, and when do they start?

The first thing to rerun when JAX (or its CUDA plugin) is upgraded: an early, chunked
host update relies on what this shows. It builds a bf16 MLP whose weight gradients go to
host memory per layer and are consumed by K `compute_on('device_host')` regions, one
chunk of layers each, in backward order (`tests.tooling.probes.host_chunks_program`),
compiles it for an H100 with no GPU (the runner's scheduler options) and reports how many
host calls the compiled program has and where they start relative to the backward
pass's last gemm. `--link`:

* `none`: the regions share no value. XLA's host-call wrapper merges them into one call
  (an instruction disconnected from the current call is included in it).
* `host`: region k+1 takes a token from region k, host to host: still one call.
* `device`: region k's token, computed from all its outputs, goes through a device op
  into region k+1: an indirect connection, so each region is its own call, and the
  early ones start while the backward pass still runs.

  JAX_PLATFORMS=cpu python3.12 experiments/host_chunks_probe.py --chunks 3 --link device
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')


def probe(chunks: int, link: str, layers: int = 6, width: int = 1024) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow  # pylint: disable=import-outside-toplevel
  from tests.tooling import probes  # pylint: disable=import-outside-toplevel
  fn, args, jit_kwargs = probes.host_chunks_program(chunks, probes.Link(link), layers, width)
  program = dataflow.compile_for_gpu(fn, *args, **jit_kwargs)
  schedule = program.schedule
  last_gemm = max(schedule.gemm_positions)
  calls = schedule.host_calls
  return dict(jax=jax.__version__, chunks=chunks, link=link, layers=layers,
              host_calls=len(calls), starts=[c.start for c in calls],
              dones=[c.done for c in calls], last_gemm=last_gemm,
              started_before_last_gemm=schedule.host_calls_started_before(last_gemm),
              gemms_inside=[sum(c.start < g < c.done for g in schedule.gemm_positions)
                            for c in calls])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--chunks', type=int, default=3)
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--width', type=int, default=1024)
  parser.add_argument('--link', choices=('none', 'host', 'device'), default='device')
  args = parser.parse_args(argv)
  print(json.dumps(probe(args.chunks, args.link, args.layers, args.width)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
