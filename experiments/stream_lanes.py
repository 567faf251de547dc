"""The device tiers' stream, lane by lane: what a GPU runs one after another.

XLA runs a stream region's copies synchronously, one after another on the region's
stream (`dos_jax.dataflow.thunks`; tests/test_compiled_family.py's
`test_one_stream_region_runs_its_transfers_one_after_another` shows it on three rows in
one region). In one region every streamed row's write-back would run before the next
row's fetch could start: the link would carry one direction at a time. The step runs
the device tiers in stream lanes (`dos_jax.step.lanes`: one region per lane,
consecutive rows on different streams), so the next row's fetch runs on another stream.

For each MLP of the family (`tests.tooling.probes.mlp_step`: Stride(2), clipping, the one
construction with no `Offload` field beyond the policy) compiled for an H100 with the
CUDA plugin, this prints one JSON line: the stream regions and their streams, the
streamed rows, the pairs (write-back, next fetch) that run on one stream, whether the
schedule reads full duplex, the host calls, and the device updates outside every host
call's window.

    JAX_PLATFORMS=cpu python3.12 experiments/stream_lanes.py [--shapes 8x1024xbfloat16 ...]
        [--runner 125m 1.3b]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

from dos_jax import dataflow
from tests.tooling import probes

FAMILY = ('2x4096xbfloat16', '5x512xfloat32', '8x1024xbfloat16', '16x256xbfloat16',
          '16x1024xfloat32', '4x2048xfloat32')


def measure(layers: int, width: int, dtype: str) -> dict:
  fn, args, kw = probes.mlp_step(layers, width, dtype=dtype)
  start = time.perf_counter()
  program = dataflow.compile_for_gpu(fn, *args, thunks=True, **kw)
  return summary(f'{layers}x{width}x{dtype}', program, start)


def summary(name: str, program, start: float) -> dict:
  schedule = program.schedule
  return {
      'shape': name, 'compile_s': round(time.perf_counter() - start, 1),
      'regions': [[r.name, r.stream] for r in program.thunks.regions()],
      'streamed_rows': len(schedule.streamed_rows),
      'transfers_one_after_another': len(program.transfers_one_after_another()),
      'schedule_full_duplex': schedule.stream_full_duplex(),
      'host_calls': len(schedule.host_calls),
      'device_updates_outside_host_calls': len(schedule.device_updates_outside_host_calls()),
  }


def runner(preset: str) -> dict:
  """The runner's step of `configs/<preset>.yaml` at batch 1, as its one builder makes it."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from tests.tooling import gpu_program  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(str(pathlib.Path(__file__).parents[1] / 'configs' / f'{preset}.yaml'),
                        ['data.batch_size=1'])
  start = time.perf_counter()
  return summary(preset, gpu_program.compile_step(cfg, 'h100_sxm', thunks=True), start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--shapes', nargs='*', default=list(FAMILY))
  parser.add_argument('--runner', nargs='*', default=[],
                      help='runner presets to compile too (tiny, 125m, 1.3b)')
  args = parser.parse_args()
  for shape in args.shapes:
    layers, width, dtype = shape.split('x')
    print(json.dumps(measure(int(layers), int(width), dtype)), flush=True)
  for preset in args.runner:
    print(json.dumps(runner(preset)), flush=True)


if __name__ == '__main__':
  main()
