"""Where the early host calls start, with and without their profiled latency.

Compiles steps with early host calls for an H100 (CUDA plugin, no GPU) twice: as XLA's
scheduler places them by its own latency estimate (`early_windows=False`), and as
dos_jax compiles them (`dataflow.early_windows`: each early call given a latency no step
covers). For each it prints the host calls' (start, done) positions,
the last backward gemm, the gemms inside early windows, the gemms held back (issued
before an early start that does not wait for them, outside an earlier window), device
updates outside host windows, and the compiled device peak. The first thing to rerun
when JAX is upgraded, with `host_chunks_probe.py`.

  JAX_PLATFORMS=cpu python3.12 experiments/early_windows.py --mlp
  JAX_PLATFORMS=cpu python3.12 experiments/early_windows.py --runner configs/125m.yaml \
      --set data.batch_size=1 --calls 4

The MLP family takes K host calls of near-equal size (`dos_jax.migrate(..., early=...)`);
a runner config takes the early calls its builder chose (`train.optimizer.build_optimizer`),
or `--calls K`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# (layers, width, dtype, call_count): tests/test_compiled_early_calls.py's family.
MLP_SHAPES = ((5, 4096, 'float32', 2), (7, 512, 'float32', 3), (8, 1024, 'bfloat16', 4),
              (16, 256, 'bfloat16', 4), (16, 1024, 'float32', 4), (6, 2048, 'bfloat16', 2),
              (10, 1024, 'float32', 2), (4, 256, 'float32', 2), (14, 768, 'bfloat16', 2),
              (11, 384, 'float32', 5))


def facts(program) -> str:
  """One line of the early-window facts of a compiled program."""
  from dos_jax.dataflow import early_windows  # pylint: disable=import-outside-toplevel
  schedule = program.schedule
  calls = schedule.host_calls
  early = calls[:-1]
  inside = sum(1 for c in early for g in schedule.gemm_positions if c.start < g < c.done)
  return (f'calls {[(c.start, c.done) for c in calls]}; last gemm'
          f' {max(schedule.gemm_positions)}; gemms in early windows {inside}; held back'
          f' {len(early_windows.gemms_held_back(program.hlo_text))}; device updates outside'
          f' {len(schedule.device_updates_outside_host_calls())}; peak'
          f' {program.memory.device_peak_bytes / 1e6:.1f} MB; {program.compile_s:.1f} s')


def _early(host, calls: int) -> tuple[int, ...]:
  """The early calls' sizes of `calls` near-equal host calls over the host subgroups."""
  from dos_jax.geometry import partition as partition_lib  # pylint: disable=import-outside-toplevel
  return tuple(len(p) for p in partition_lib.host_calls(host, calls)[:-1])


def _runner_program(cfg, calls: int | None, profiled: bool):
  """The runner's step compiled as `gpu_program.compile_step` does, with `calls` host
  calls of near-equal size moved in (None: the builder's)."""
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow  # pylint: disable=import-outside-toplevel
  from tests.tooling import gpu_program  # pylint: disable=import-outside-toplevel
  from dos_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  if calls is None:
    return gpu_program.compile_step(cfg, early_windows=profiled)
  native = dataflow.compile.prepare()
  program = gpu_program.build_step(cfg)
  part = program.offloaded_state.partition
  opt_state = dos_jax.migrate(program.opt_state, part.plan, early=_early(part.host, calls))
  options = step_lib.compiler_options_for('gpu')
  with dos_jax.compiled_with(options):  # the step traced told their limit
    lowered = dataflow.lower_for_gpu(program.step, program.params, opt_state, program.tokens,
                                     kwargs={'plan': None})
  return dataflow.compile_lowered(lowered, 'h100_sxm', options, native_host_kernel=native,
                                  early_windows=profiled)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--mlp', action='store_true', help='the MLP family of the tests')
  parser.add_argument('--runner', action='append', default=[], help='a runner config')
  parser.add_argument('--set', dest='overrides', action='append', default=[])
  parser.add_argument('--calls', type=int, default=None,
                      help="a runner config's host calls (default: its builder's choice)")
  args = parser.parse_args(argv)

  from dos_jax import dataflow  # pylint: disable=import-outside-toplevel
  from tests.tooling import probes  # pylint: disable=import-outside-toplevel
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel

  if args.mlp:
    for layers, width, dtype, chunks in MLP_SHAPES:
      early = _early(range(layers // 2), chunks)  # Stride(2): layers // 2 host subgroups
      fn, fn_args, jit_kwargs = probes.mlp_step(layers, width, dtype=dtype, early=early)
      print(f'== {layers} x {width} {dtype}, {chunks} host calls (early={early})')
      for profiled in (False, True):
        program = dataflow.compile_for_gpu(fn, *fn_args, early_windows=profiled, **jit_kwargs)
        print(f'  {"profiled" if profiled else "XLA alone"}: {facts(program)}')
      sys.stdout.flush()
  for path in args.runner:
    cfg = config_lib.load(path, args.overrides)
    print(f'== {path} {" ".join(args.overrides)}'
          + (f' --calls {args.calls}' if args.calls else ''))
    for profiled in (False, True):
      program = _runner_program(cfg, args.calls, profiled)
      print(f'  {"profiled" if profiled else "XLA alone"}: {facts(program)}')
    sys.stdout.flush()
  return 0


if __name__ == '__main__':
  sys.exit(main())
