"""Tiny-model train step time: dos_jax AdamW against optax.adamw, or the one-program
step against the two-program one.

Both runs are built from the same config by the runner itself (`trainer.build`), take
the same batches and are timed in alternating rounds in one process, so machine load
affects both alike. Two comparisons:

  --compare optax (default): dos_jax (a placement policy) against optax.adamw, both in
      `--form` (default split: the update phase is timed on its own). Reported: median
      step, grad-phase and update-phase times, and the ratio dos_jax / optax (goal on
      CPU: step time within 1.10x).
  --compare forms: the dos_jax run's fused step (forward to applied update in one
      program, what the runner runs) against its split form (gradients, then update:
      the runner before the fused step, and its timing steps now). Reported: median
      step times and the ratio fused / split (goal: <= 1).

  python experiments/bench_train.py [--compare optax|forms] [--form split|fused]
      [--policy all_host] [--rounds 40] [--steps 1] [--set KEY=VALUE ...]
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


def _runs(args, cfg) -> dict:
  """name -> (run, split?): the two runs compared."""
  devices = jax.devices()[:1]
  if args.compare == 'forms':
    return {
        f'{args.policy} fused': (trainer.build(cfg, devices=devices), False),
        f'{args.policy} split': (trainer.build(cfg, devices=devices), True),
    }
  split = args.form == 'split'
  return {
      f'dos_jax {args.policy}': (trainer.build(cfg, devices=devices), split),
      'optax.adamw': (trainer.build(
          cfg, devices=devices, tx=step.make_optimizer(cfg.optim, None, cfg.train.steps)
      ), split),
  }


def _timed(args, runs) -> dict:
  """Per run, the step (and grad, update) seconds of each timed step: rounds that
  time the runs back to back, after untimed warm-up steps; no step compiles again."""
  sampler = next(iter(runs.values()))[0].train_sampler()
  batches = [next(sampler) for _ in range(args.warmup + args.rounds * args.steps)]
  for run, split in runs.values():
    for batch in batches[:args.warmup]:
      run.step(batch, split=split)
  times = {name: {'step': [], 'grad': [], 'update': []} for name in runs}
  position = args.warmup
  for _ in range(args.rounds):
    chunk = batches[position:position + args.steps]
    position += args.steps
    for name, (run, split) in runs.items():
      for batch in chunk:
        result = run.step(batch, split=split)
        assert not result.compiled, name
        times[name]['step'].append(result.step_s)
        if split:
          times[name]['grad'].append(result.grad_s)
          times[name]['update'].append(result.update_s)
  for name, (run, split) in runs.items():
    expected = {'fused': 0, 'grad': 1, 'update': 1} if split else {'fused': 1, 'grad': 0, 'update': 0}
    assert run.compile_counts() == expected, (name, run.compile_counts())
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--compare', choices=('optax', 'forms'), default='optax',
                      help='dos_jax vs optax.adamw, or fused vs split step (default: optax)')
  parser.add_argument('--form', choices=('split', 'fused'), default='split',
                      help='step form of both runs for --compare optax (default: split)')
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
  runs = _runs(args, cfg)
  times = _timed(args, runs)

  ours, ref = list(runs)
  median_ms = lambda xs: 1e3 * statistics.median(xs) if xs else float('nan')
  summary = {
      name: {'step_ms': median_ms(t['step']), 'grad_ms': median_ms(t['grad']),
             'update_ms': median_ms(t['update'])}
      for name, t in times.items()
  }
  dos = next(iter(runs.values()))[0]
  record = {
      'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
      'machine': f'{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}',
      'load_average': os.getloadavg(),
      'compare': args.compare,
      'model': cfg.model.preset,
      'params': sum(x.size for x in jax.tree.leaves(dos.params)),
      'subgroups': dos.opt_state.layout.num_subgroups,
      'batch': f'{cfg.data.batch_size}x{cfg.data.seq_len}',
      'timed_steps': args.rounds * args.steps,
      'results': summary,
      'step_ratio': summary[ours]['step_ms'] / summary[ref]['step_ms'],
  }
  # Paired ratios: each round times both runs back to back, so the per-round ratio
  # cancels load that changes between rounds.
  paired = [a / b for a, b in zip(times[ours]['step'], times[ref]['step'])]
  record['paired_step_ratio'] = statistics.median(paired)
  print(f"{record['date']}; {record['machine']}; load {record['load_average'][0]:.1f}")
  print(f"model {record['model']} ({record['params']:,} params, {record['subgroups']}"
        f" subgroups), batch {record['batch']}, {record['timed_steps']} timed steps each")
  print(f"{'run':<22} {'step ms':>9} {'grad ms':>9} {'update ms':>10}")
  for name, row in summary.items():
    print(f"{name:<22} {row['step_ms']:>9.1f} {row['grad_ms']:>9.1f} {row['update_ms']:>10.2f}")
  if args.compare == 'forms':
    print(f"step ratio fused / split {record['step_ratio']:.3f}x"
          f" (median of per-round ratios {record['paired_step_ratio']:.3f}x)")
  elif args.form == 'split':
    record['update_ratio'] = summary[ours]['update_ms'] / summary[ref]['update_ms']
    # Both runs' grad phase is the same program: on a loaded machine its noise can
    # swamp the update phase, so also compare with the grad phase pooled over both runs.
    pooled_grad = median_ms(sum((t['grad'] for t in times.values()), []))
    record['pooled_grad_ms'] = pooled_grad
    record['step_ratio_pooled_grad'] = (
        (pooled_grad + summary[ours]['update_ms']) / (pooled_grad + summary[ref]['update_ms'])
    )
    print(f"step ratio {record['step_ratio']:.3f}x (with the grad phase pooled:"
          f" {record['step_ratio_pooled_grad']:.3f}x), update ratio"
          f" {record['update_ratio']:.2f}x (dos_jax / optax)")
  else:
    print(f"step ratio {record['step_ratio']:.3f}x (median of per-round ratios"
          f" {record['paired_step_ratio']:.3f}x) (dos_jax / optax, fused steps)")
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=2)


if __name__ == '__main__':
  main()
