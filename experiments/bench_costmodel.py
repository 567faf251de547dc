"""Predicted vs measured update time of `dos_jax.adamw` for several plans on this machine.

Calibrates this machine (`dos_jax.planner.calibrate.calibrate`), then for each plan jits one
offloaded AdamW step (update + `optax.apply_updates`, params and state donated) over a
state of `--elements` fp32 parameters; all plans are timed round-robin (`--reps`
rounds; median and min). The cost
model's prediction for the same plan sits next to it, with the error. `jax.jit` of
`optax.adamw` on the same params is timed in the same run as the baseline. A last
column shows the predictions after three factors are fitted on the pure plans (host
AdamW on AllHost, device AdamW on AllDevice, the copies on Stride(1)), which tests how
the model composes the paths for the mixed plans.

  python experiments/bench_costmodel.py [--elements 64e6] [--subgroup-size 8e6] [--reps 7]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax
from dos_jax.planner import calibrate
from dos_jax.planner import costmodel
from dos_jax.planner import fitting
from dos_jax.policies import SubgroupSpec


def interleaved_times(runners: dict, reps: int) -> dict[str, tuple[float, float]]:
  """(median, min) wall time per runner, timed round-robin after one warm-up each, so
  that load from other processes on a shared machine falls on every plan alike. The
  min is the figure to trust there: interference only adds time."""
  for run in runners.values():
    run()  # compile and warm up
  times = {name: [] for name in runners}
  for _ in range(reps):
    for name, run in runners.items():
      t0 = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t0)
  return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def make_params(elements: int, seed: int = 0) -> dict:
  """A few leaves of mixed shapes whose sizes add up to about `elements`."""
  rng = np.random.default_rng(seed)
  width = 4096
  rows = elements // width
  a, b = rows // 2, rows - rows // 2 - 1
  return {
      'embed': jnp.asarray(rng.standard_normal((a, width), dtype=np.float32)),
      'mlp': jnp.asarray(rng.standard_normal((b, width), dtype=np.float32)),
      'norm': jnp.asarray(rng.standard_normal((width,), dtype=np.float32)),
      'bias': jnp.asarray(rng.standard_normal((elements - (a + b + 1) * width,), dtype=np.float32)),
  }


def spec_for(params, subgroup_size: int) -> SubgroupSpec:
  """The core's SubgroupSpec when it has one; else the fp32 layout written by hand."""
  layout = getattr(dos_jax, 'layout', None)
  if layout is not None and hasattr(layout, 'spec_for'):
    return layout.spec_for(params, subgroup_size)
  n = sum(x.size for x in jax.tree.leaves(params))
  return SubgroupSpec(math.ceil(n / subgroup_size), subgroup_size, n, 8, 4, 4)


def step_runner(params, tx) -> callable:
  """A zero-argument function running one jitted, donated step of `tx` (update and
  `optax.apply_updates`) on its own copy of the params and state."""
  state = tx.init(params)
  grads = jax.tree.map(lambda x: x * 1e-3, params)
  params = jax.tree.map(jnp.copy, params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  box = [params, state]

  def run():
    box[0], box[1] = step(box[0], box[1], grads)
    jax.block_until_ready(box)

  return run


# The paper's update throughput (docs/planner.md), 1e9 params/s per 4-GPU node, by stride (0 = CPU only).
PAPER_THROUGHPUT = {
    ('20b', 'h100-pcie5'): {0: 8.6, 2: 15.3, 3: 14.9, 4: 14.2, 10: 12.7},
    ('20b', 'a100-pcie4'): {0: 3.8, 2: 5.7, 3: 5.6, 4: 5.3, 10: 5.1},
    ('13b', 'h100-pcie5'): {0: 7.7, 2: 13.6, 3: 13.2, 4: 12.2, 10: 10.7},
    ('7b', 'h100-pcie5'): {0: 7.8, 2: 14.2, 3: 13.4, 4: 12.5, 10: 11.1},
}


def paper_check() -> list[tuple[str, str, int, float, float]]:
  """The node presets against the paper's measured update throughput, printed as a
  table; returns its rows (model, node, stride (0: CPU only), paper's and predicted
  Gparam/s). Two preset numbers come from the 20B rows (host AdamW from 'CPU only',
  the concurrent link rate from k=2), so those two cells are fits; every other cell is
  a prediction."""
  rows = []
  from dos_jax import model_shapes  # pylint: disable=import-outside-toplevel
  print('| model, node | stride | paper Gparam/s | predicted Gparam/s | error |')
  print('|---|---|---|---|---|')
  for (model, node), row in PAPER_THROUGHPUT.items():
    profile = costmodel.PROFILE_PRESETS[node]
    n = math.ceil(model_shapes.preset(model).num_params() / 4)
    spec = SubgroupSpec(math.ceil(n / 10**8), 10**8, n, 12, 2, 2)
    for k, paper in row.items():
      policy = dos_jax.AllHost() if k == 0 else dos_jax.Stride(k)
      seconds = costmodel.predict(profile, spec, policy.plan(spec), backward_seconds=10.0).update_seconds
      ours = 4 * n / seconds / 1e9
      print(f'| {model}, {node} | {k or "CPU only"} | {paper} | {ours:.1f} | {(ours - paper) / paper:+.0%} |')
      rows.append((model, node, k, paper, ours))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--elements', type=float, default=64e6)
  parser.add_argument('--subgroup-size', type=float, default=8e6)
  parser.add_argument('--reps', type=int, default=7)
  parser.add_argument('--calibrate-seconds', type=float, default=3.0)
  parser.add_argument('--paper', action='store_true', help='only compare the node presets with the paper')
  args = parser.parse_args(argv)
  if args.paper:
    paper_check()
    return 0
  if not hasattr(dos_jax, 'adamw'):
    print('dos_jax.adamw is not available yet (the core has not landed)', file=sys.stderr)
    return 1
  elements, subgroup = int(args.elements), int(args.subgroup_size)

  profile = calibrate.calibrate(args.calibrate_seconds, sizes=(subgroup,))
  print(f'# profile: {profile.to_json()}')
  params = make_params(elements)
  spec = spec_for(params, subgroup)
  policies = [
      ('AllHost', dos_jax.AllHost()), ('Stride(1)', dos_jax.Stride(1)), ('Stride(2)', dos_jax.Stride(2)),
      ('Stride(4)', dos_jax.Stride(4)), ('DeviceFraction(0.25)', dos_jax.DeviceFraction(0.25)),
      ('AllDevice', dos_jax.AllDevice()),
  ]
  runners = {'optax': step_runner(params, optax.adamw(1e-3, weight_decay=1e-4))}
  for name, policy in policies:
    offload = dos_jax.Offload(subgroup_size=spec.subgroup_size, policy=policy)
    runners[name] = step_runner(params, dos_jax.adamw(1e-3, offload=offload))
  measured = interleaved_times(runners, args.reps)
  baseline, baseline_min = measured.pop('optax')
  print(f'\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {elements:,} fp32 params in'
        f' {spec.num_subgroups} subgroups of {spec.subgroup_size:,}; {args.reps} interleaved rounds')
  print(f'jax.jit(optax.adamw) baseline: median {baseline * 1e3:.1f} ms, min {baseline_min * 1e3:.1f} ms')
  # Factors fitted on the pure plans: host AdamW from AllHost, device AdamW from
  # AllDevice, the copies from Stride(1); the mixed plans are then predicted.
  plan_of = {name: policy.plan(spec) for name, policy in policies}
  fitted, _ = fitting.fit_correction(profile, spec, plan_of['AllHost'], measured['AllHost'][1])
  fitted, _ = fitting.fit_correction(fitted, spec, plan_of['AllDevice'], measured['AllDevice'][1])
  predict_stride1 = lambda x: costmodel.predict(fitted.scaled(links=x), spec, plan_of['Stride(1)']).update_seconds
  links = fitting.solve_scale(predict_stride1, measured['Stride(1)'][1])
  fitted = fitted.scaled(links=links) if links else fitted
  print('\n| plan | predicted ms | measured median ms | error | measured min ms | error |'
        ' predicted after fit ms | error vs min | min vs optax min |')
  print('|---|---|---|---|---|---|---|---|---|')
  errors = []
  for name, _ in policies:
    median, fastest = measured[name]
    predicted = costmodel.predict(profile, spec, plan_of[name]).update_seconds
    after = costmodel.predict(fitted, spec, plan_of[name]).update_seconds
    err, err_min, err_fit = ((x - y) / y for x, y in ((predicted, median), (predicted, fastest), (after, fastest)))
    errors.append((abs(err), abs(err_min), abs(err_fit)))
    print(f'| {name} | {predicted * 1e3:.1f} | {median * 1e3:.1f} | {err:+.1%} |'
          f' {fastest * 1e3:.1f} | {err_min:+.1%} | {after * 1e3:.1f} | {err_fit:+.1%} |'
          f' {fastest / baseline_min:.2f}x |')
  print(f'\nmax |error|: calibrated vs median {max(e[0] for e in errors):.1%}, vs min'
        f' {max(e[1] for e in errors):.1%}; after the three-factor fit vs min {max(e[2] for e in errors):.1%}')
  print(f'fitted profile: host AdamW {fitted.host_adamw_gparams():.3g} Gparam/s (calibrated'
        f' {profile.host_adamw_gparams():.3g}), device AdamW {fitted.device_adamw_gparams:.3g}'
        f' (calibrated {profile.device_adamw_gparams:.3g}), copies {fitted.h2d_gbps:.3g} GB/s'
        f' (calibrated {profile.h2d_gbps:.3g})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
