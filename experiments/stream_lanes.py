"""The device tiers' stream, lane by lane: what a GPU runs one after another.

XLA runs a stream region's copies synchronously, one after another on the region's
stream (`dos_jax.dataflow.thunks`). With the device tiers in one region, every
streamed row's write-back runs before the next row's fetch can start: the link carries
one direction at a time. With `stream_lanes` (one region per lane, consecutive rows on
different streams) the next row's fetch runs on another stream.

For each MLP of the family (`dataflow.probes.mlp_step`, per-subgroup storage,
Stride(2), clipping) compiled for an H100 with the CUDA plugin, this prints one JSON
line per form: the stream regions and their streams, the streamed rows, the pairs
(write-back, next fetch) that run on one stream, whether the schedule reads full
duplex, and whether the host call's window overlaps every region's.

    JAX_PLATFORMS=cpu python3.12 experiments/stream_lanes.py [--shapes 8x1024xbfloat16 ...]
        [--runner 125m 1.3b]

`one_region` is the form before lanes (`Offload(stream_lanes=1)`: the device tiers in
one region); `stacked` the stacked tier's loop, outside any region, whose asynchronous
slices get streams from XLA's round-robin.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from dos_jax import dataflow
from dos_jax.dataflow import probes

FAMILY = ('2x4096xbfloat16', '5x512xfloat32', '8x1024xbfloat16', '16x256xbfloat16',
          '16x1024xfloat32', '4x2048xfloat32')


FORMS = {'one_region': dict(storage='per_subgroup', stream_lanes=1),
         'lanes': dict(storage='per_subgroup'), 'stacked': dict(storage='stacked')}


def measure(layers: int, width: int, dtype: str, form: str) -> dict:
  fn, args, kw = probes.mlp_step(layers, width, dtype=dtype, **FORMS[form])
  start = time.perf_counter()
  program = dataflow.compile_for_gpu(fn, *args, thunks=True, **kw)
  return summary(f'{layers}x{width}x{dtype}', form, program, start)


def summary(name: str, form: str, program, start: float) -> dict:
  schedule = program.schedule
  return {
      'shape': name, 'form': form, 'compile_s': round(time.perf_counter() - start, 1),
      'regions': [[r.name, r.stream] for r in program.thunks.regions()],
      'streamed_rows': len(schedule.streamed_rows),
      'transfers_one_after_another': len(program.transfers_one_after_another()),
      'schedule_full_duplex': schedule.stream_full_duplex(),
      'host_calls': len(schedule.host_calls),
      'device_updates_outside_host_calls': len(schedule.device_updates_outside_host_calls()),
  }


def runner(preset: str, form: str) -> dict:
  """The runner's step of `configs/<preset>.yaml` at batch 1."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from dos_jax.train import gpu_program  # pylint: disable=import-outside-toplevel
  overrides = ['data.batch_size=1', f'offload.storage={FORMS[form]["storage"]}',
               f'offload.stream_lanes={FORMS[form].get("stream_lanes", 0)}',
               'offload.early_chunks=0']
  cfg = config_lib.load(str(pathlib.Path(__file__).parents[1] / 'configs' / f'{preset}.yaml'),
                        overrides)
  start = time.perf_counter()
  return summary(preset, form, gpu_program.compile_step(cfg, 'h100_sxm', thunks=True), start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--shapes', nargs='*', default=list(FAMILY))
  parser.add_argument('--forms', nargs='*', default=list(FORMS), choices=list(FORMS))
  parser.add_argument('--runner', nargs='*', default=[],
                      help='runner presets to compile too (tiny, 125m, 1.3b)')
  args = parser.parse_args()
  for shape in args.shapes:
    layers, width, dtype = shape.split('x')
    for form in args.forms:
      print(json.dumps(measure(int(layers), int(width), dtype, form)), flush=True)
  for preset in args.runner:
    for form in args.forms:
      print(json.dumps(runner(preset, form)), flush=True)


if __name__ == '__main__':
  main()
