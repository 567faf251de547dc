"""The construction's schedule facts under each option set a user may pass, on the CUDA
plugin installed: the README's step and a held-out family, compiled for an H100.

For the README's step (`tests.tooling.probes.mlp_step(8, 1024)`: 8 x 1024 bf16 MLP,
Stride(2), clipped, nothing but the policy set) and the family
`schedule_family.QUICK` x (bf16, fp32), under `GPU_COMPILER_OPTIONS` (what `dos_jax.jit`
and the runner compile with), the latency-hiding scheduler alone (a plain `jax.jit` with
it in `XLA_FLAGS`: XLA's default limit of 2 asynchronous calls) and XLA's defaults, it
prints one JSON line per option set: device updates inside a host call's window, fetches
independent of write-backs, host calls starting during the backward pass (of the
README's step), and how many held-out programs have every device update inside a host
call's window. No GPU needed (Python 3.12, `jax[cuda13]`).

  JAX_PLATFORMS=cpu python3.12 experiments/option_table.py > table.jsonl
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPTION_SETS = {
    'project': None,  # GPU_COMPILER_OPTIONS
    'scheduler_alone': {'xla_gpu_enable_latency_hiding_scheduler': True},
    'xla_defaults': {},
}


def _facts(program) -> dict:
  s = program.schedule
  updates = len(s.device_updates())
  last_gemm = max(s.gemm_positions, default=-1)
  return dict(
      device_updates=updates,
      inside_host_calls=updates - len(s.device_updates_outside_host_calls()),
      streamed_rows=len(s.streamed_rows),
      fetches_independent=sum(not r.after_previous_write_back for r in s.streamed_rows),
      host_calls=len(s.host_calls),
      host_calls_during_backward=s.host_calls_started_before(last_gemm),
      host_to_host_copies=len(s.large_host_copies()))


def main() -> int:
  import warnings  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow  # pylint: disable=import-outside-toplevel
  from tests.tooling import probes  # pylint: disable=import-outside-toplevel
  from dos_jax import lowering as lowering_lib  # pylint: disable=import-outside-toplevel
  import schedule_family  # pylint: disable=import-outside-toplevel
  warnings.filterwarnings('ignore', message='dos_jax:')
  dataflow.compile.prepare()
  print(json.dumps({'jax': jax.__version__, 'lowering': lowering_lib.of_version().value}),
        flush=True)
  family = [(l, w, d) for l, w in schedule_family.QUICK for d in ('bfloat16', 'float32')]
  for name, options in OPTION_SETS.items():
    row = {'options': name}
    try:
      fn, args, kw = probes.mlp_step(8, 1024)
      row['readme_step'] = _facts(dataflow.compile_for_gpu(fn, *args, compiler_options=options,
                                                           **kw))
      held = []
      for layers, width, dtype in family:
        fn, args, kw = probes.mlp_step(layers, width, dtype=dtype)
        f = _facts(dataflow.compile_for_gpu(fn, *args, compiler_options=options, **kw))
        held.append(f['inside_host_calls'] == f['device_updates'])
      row['held_out_all_inside'] = [sum(held), len(held)]
    except Exception as e:  # pylint: disable=broad-except
      row['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    print(json.dumps(row), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
