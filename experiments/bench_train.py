"""Tiny-model train step time: dos_jax AdamW (a placement policy) against optax.adamw.

Both runs are built from the same config by the runner itself (`trainer.build`), take
the same batches and are timed in alternating rounds in one process, so machine load
affects both alike. Reported: median step time, median update-phase time, and the ratio
dos_jax / optax (goal on CPU: step time within 1.10x).

  python experiments/bench_train.py [--policy all_host] [--rounds 40] [--steps 1]
      [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import jax

from dos_jax.train import config, step, trainer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--policy', default='all_host',
                      help='offload.policy for the dos_jax run (default: all_host)')
  parser.add_argument('--rounds', type=int, default=40, help='alternating timing rounds')
  parser.add_argument('--steps', type=int, default=1, help='steps per run per round')
  parser.add_argument('--warmup', type=int, default=3, help='untimed steps per run first')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='config override, as for dos-jax train')
  parser.add_argument('--json', help='also write the results as JSON to this file')
  args = parser.parse_args()

  cfg = config.load(None, [f'offload.policy={args.policy}', *args.set])
  devices = jax.devices()[:1]
  runs = {
      f'dos_jax {args.policy}': trainer.build(cfg, devices=devices),
      'optax.adamw': trainer.build(
          cfg, devices=devices, tx=step.make_optimizer(cfg.optim, None, cfg.train.steps)
      ),
  }
  sampler = next(iter(runs.values())).train_sampler()
  batches = [next(sampler) for _ in range(args.warmup + args.rounds * args.steps)]
  for run in runs.values():
    for batch in batches[:args.warmup]:
      run.step(batch)
  times = {name: {'step': [], 'grad': [], 'update': []} for name in runs}
  position = args.warmup
  for _ in range(args.rounds):
    chunk = batches[position:position + args.steps]
    position += args.steps
    for name, run in runs.items():
      for batch in chunk:
        result = run.step(batch)
        times[name]['step'].append(result.step_s)
        times[name]['grad'].append(result.grad_s)
        times[name]['update'].append(result.update_s)
  for name, run in runs.items():
    assert run.compile_counts() == {'grad': 1, 'update': 1}, (name, run.compile_counts())

  ours, ref = list(runs)
  summary = {
      name: {
          'step_ms': 1e3 * statistics.median(t['step']),
          'grad_ms': 1e3 * statistics.median(t['grad']),
          'update_ms': 1e3 * statistics.median(t['update']),
      }
      for name, t in times.items()
  }
  dos = next(iter(runs.values()))
  record = {
      'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
      'machine': f'{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}',
      'load_average': os.getloadavg(),
      'model': cfg.model.preset,
      'params': sum(x.size for x in jax.tree.leaves(dos.params)),
      'subgroups': dos.opt_state.layout.num_subgroups,
      'batch': f'{cfg.data.batch_size}x{cfg.data.seq_len}',
      'timed_steps': args.rounds * args.steps,
      'results': summary,
      'step_ratio': summary[ours]['step_ms'] / summary[ref]['step_ms'],
      'update_ratio': summary[ours]['update_ms'] / summary[ref]['update_ms'],
  }
  # Both runs' grad phase is the same program: on a loaded machine its noise can swamp
  # the update phase, so also compare with the grad phase pooled over both runs.
  pooled_grad = 1e3 * statistics.median(sum((t['grad'] for t in times.values()), []))
  record['pooled_grad_ms'] = pooled_grad
  record['step_ratio_pooled_grad'] = (
      (pooled_grad + summary[ours]['update_ms']) / (pooled_grad + summary[ref]['update_ms'])
  )
  print(f"{record['date']}; {record['machine']}; load {record['load_average'][0]:.1f}")
  print(f"model {record['model']} ({record['params']:,} params, {record['subgroups']}"
        f" subgroups), batch {record['batch']}, {record['timed_steps']} timed steps each")
  print(f"{'run':<22} {'step ms':>9} {'grad ms':>9} {'update ms':>10}")
  for name, row in summary.items():
    print(f"{name:<22} {row['step_ms']:>9.1f} {row['grad_ms']:>9.1f} {row['update_ms']:>10.2f}")
  print(f"step ratio {record['step_ratio']:.3f}x (with the grad phase pooled:"
        f" {record['step_ratio_pooled_grad']:.3f}x), update ratio"
        f" {record['update_ratio']:.2f}x (dos_jax / optax)")
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=2)


if __name__ == '__main__':
  main()
