"""The runner's step compiled for an H100 beside the timeline the cost model predicts.

For each config it compiles the runner's step with the CUDA plugin (no GPU needed) and
prints the schedule's order of the events that matter, by instruction position: the
last backward gemm, each host call's start and done, each device update (a stream call's
start and done, a Pallas call or
update loop), and the first and last weight-gradient copy to host. Beside it,
`dos_jax.planner.timeline` for the same plan and state on the `h100-pcie5` profile (the
forward and backward times at its default achieved TFLOP/s, as `dos-jax plan`).

  JAX_PLATFORMS=cpu python3.12 experiments/timeline_vs_schedule.py \
      --config configs/125m.yaml --config configs/1.3b.yaml --set data.batch_size=1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

_TFLOPS = 200.0  # plan_cli's default for h100-pcie5


def schedule_events(schedule) -> list[tuple[int, str]]:
  """(position, event) of one compiled schedule, in order."""
  events = []
  if schedule.gemm_positions:
    events.append((max(schedule.gemm_positions), 'last gemm (end of backward)'))
  for k, call in enumerate(schedule.host_calls, 1):
    events.append((call.start, f'host call {k} start'))
    events.append((call.done, f'host call {k} done'))
  for p in schedule.update_positions:
    events.append((p, 'device update'))
  for call in schedule.stream_calls:  # the device tiers on their own stream
    if call.updates:
      events.append((call.start, 'device update on its stream: start'))
      events.append((call.done, 'device update on its stream: done'))
  copies = schedule.gradient_copies()
  if copies:
    overlapping = sum(c.gemms_between > 0 for c in copies)
    events.append((min(c.start for c in copies),
                   f'first of {len(copies)} gradient copies to host ({overlapping} with gemms'
                   ' in flight)'))
    events.append((max(c.start for c in copies), 'last gradient copy to host'))
  return sorted(events)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', action='append', required=True)
  parser.add_argument('--set', dest='overrides', action='append', default=[])
  parser.add_argument('--target', default='h100_sxm')
  args = parser.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel

  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax.planner import costmodel, timeline  # pylint: disable=import-outside-toplevel
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from tests.tooling import gpu_program  # pylint: disable=import-outside-toplevel

  profile = costmodel.PROFILE_PRESETS['h100-pcie5']
  for path in args.config:
    cfg = config_lib.load(path, args.overrides)
    devices = jax.devices()[:1]  # abstract arguments: a 1.3b state needs no memory here
    built = gpu_program.build_step(cfg, devices)
    state = built.offloaded_state
    spec = state.layout.spec()
    part = state.partition
    plan = dos_jax.Plan(streamed=part.streamed, host=part.host, resident=part.resident)
    params = spec.num_elements
    tokens = cfg.data.seq_len * cfg.data.batch_size
    forward = 2 * params * tokens / (_TFLOPS * 1e12)
    program = gpu_program.compile_step(cfg, args.target, devices=devices)
    print(f'== {path} {" ".join(args.overrides)}: {params:,} params, {spec.num_subgroups}'
          f' subgroups ({len(plan.streamed)} streamed, {len(plan.host)} host),'
          f' compiled in {program.compile_s:.0f} s')
    print('-- compiled schedule (instruction positions of the entry computation):')
    for position, event in schedule_events(program.schedule):
      print(f'  {position:6d}  {event}')
    predicted = timeline.early_timeline(profile, spec, plan, forward_seconds=forward,
                                        backward_seconds=2 * forward, early=part.early)
    print(f'-- predicted timeline ({profile.name}, {_TFLOPS:g} TFLOP/s;'
          f' step {1e3 * predicted.seconds:.1f} ms):')
    print(predicted.table())
    sys.stdout.flush()
  return 0


if __name__ == '__main__':
  sys.exit(main())
