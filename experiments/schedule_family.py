"""The schedule facts of library steps over a family of shapes, compiled for an H100.

For every program of the family (`tests.tooling.probes.mlp_step`: an L x W MLP,
one subgroup per layer, Stride(2), clipping, bf16 and fp32, with no `Offload` field
beyond the policy: the one construction, its early host calls by the rule) it prints
one JSON line: the early host calls, the host calls and their windows, how many start
before the last backward gemm, device updates and how many are issued outside every
host call's window, whether the stream is full duplex (no row's write-back waits for
the next row's fetch, no fetch for the previous row's write-back), the device tiers'
stream calls (`dos_jax.step.lanes`), gradient copies overlapping compute, host->host
copies. `--early` sets other early host calls (`dos_jax.migrate(..., early=...)`;
`--early none`: one host call). No GPU needed: the CUDA plugin compiles (Python 3.12,
`jax[cuda13]`).

  JAX_PLATFORMS=cpu python3.12 experiments/schedule_family.py [--quick] > family.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

FAMILY = tuple(itertools.product((2, 5, 8, 16), (256, 1024, 4096)))
QUICK = ((2, 1024), (5, 512), (8, 1024), (16, 256))


def _early(text: str | None) -> tuple[int, ...] | None:
  """`--early`: None (the rule), 'none' (one host call) or sizes '2,2'."""
  if text is None:
    return None
  return () if text == 'none' else tuple(int(x) for x in text.split(','))


def facts(num_layers: int, width: int, dtype: str,
          early: tuple[int, ...] | None = None) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow  # pylint: disable=import-outside-toplevel
  from tests.tooling import probes  # pylint: disable=import-outside-toplevel
  dataflow.compile.prepare()
  fn, args, jit_kwargs = probes.mlp_step(num_layers, width, dtype=dtype, early=early)
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  state = next(x for x in jax.tree.leaves(args[1], is_leaf=is_state) if is_state(x))
  program = dataflow.compile_for_gpu(fn, *args, **jit_kwargs)
  s = program.schedule
  copies = s.gradient_copies()
  return dict(
      layers=num_layers, width=width, dtype=dtype,
      host_subgroups=len(state.partition.host), early=list(state.partition.early),
      host_calls=[[c.start, c.done] for c in s.host_calls],
      last_gemm=max(s.gemm_positions, default=-1),
      host_calls_before_last_gemm=s.host_calls_started_before(max(s.gemm_positions, default=-1)),
      gemms_in_host_windows=sum(c.start < g < c.done for c in s.host_calls
                                for g in s.gemm_positions),
      device_updates=len(s.device_updates()),
      outside_host_calls=len(s.device_updates_outside_host_calls()),
      stream_calls=[[c.start, c.done] for c in s.stream_calls if c.updates],
      streamed_rows=len(s.streamed_rows),
      full_duplex=s.stream_full_duplex(),
      write_backs_after_next_fetch=sum(r.write_back_after_next_fetch for r in s.streamed_rows),
      gradient_copies=len(copies),
      gradient_copies_overlapping=sum(c.overlaps_compute for c in copies),
      host_to_host_copies=len(s.large_host_copies()),
      native_host_kernel=program.native_host_kernel,
      compile_s=round(program.compile_s, 1))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--quick', action='store_true', help=f'only {QUICK}')
  parser.add_argument('--dtypes', default='bfloat16,float32')
  parser.add_argument('--early', default=None, metavar='SIZES',
                      help="early host calls' sizes, e.g. 2,2 ('none': one host call; "
                      'default: the rule)')
  args = parser.parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  print(json.dumps({'jax': jax.__version__}), flush=True)
  shapes = QUICK if args.quick else FAMILY
  for (layers, width), dtype in itertools.product(shapes, args.dtypes.split(',')):
    print(json.dumps(facts(layers, width, dtype, _early(args.early))), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
