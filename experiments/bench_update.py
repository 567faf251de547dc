"""Update-phase time of dos_jax.adamw per placement policy, against jit(optax.adamw).

One jitted, donated step (update + apply_updates) on a synthetic state of `--params`
elements, timed as the median of `--reps` runs after `--warmup` runs, in one process so
the ratio to optax is measured on the same machine at the same moment. The baseline is
optax.adamw on fp32 params (with bf16 params optax would keep bf16 state) fed the same
gradients; where it does not fit in device memory it is reported as such and the
policies still run.

  python experiments/bench_update.py --params 100_000_000 --subgroup-size 10_000_000
  python experiments/bench_update.py --params 1e9 --subgroup-size 1e8 --dtype bf16 \
      --policies 'AllHost,Stride(2),DeviceFraction(0.5),AllDevice' --json $OUT/update.json

Each row also gives the time of `opt.init` and of each warm-up step (the first compiles;
the second compiles again, because the state `init` returns and the state a step
returns differ in sharding), so that a large run's budget can be planned. A policy that
raises (out of memory, a CUDA error) is reported and the others still run; the exit
status is then 1 (not fitting in device memory is a result, not a failure, for the two
baselines: optax and AllDevice). `--json` is rewritten after every row, so a run cut short keeps what
it measured.

On a CPU-only machine every "device" is the CPU, so the policies differ only in the
loop structure and memory kinds; only a GPU can rank them (see RESULTS.md).

The two-memory program splits its host tier into early host calls by the rule
(`partition.early_host_calls`: here, with no backward pass to overlap, they only cut
the host work in calls); `--early none` times one host call instead
(`dos_jax.migrate(..., early=())`), `--early both` each in the same run.

`--mesh 2x2` runs on a (data, tensor) mesh of that many (virtual, on CPU) devices with
the state sharded over `data` (ZeRO-1); params are replicated, optax likewise.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax

DEFAULT_POLICIES = 'AllHost,Stride(2),DeviceFraction(0.25),AllDevice'
_POLICIES = {'allhost': dos_jax.AllHost, 'alldevice': dos_jax.AllDevice,
             'stride': dos_jax.Stride, 'devicefraction': dos_jax.DeviceFraction,
             'resident': dos_jax.Resident, 'residentfraction': dos_jax.ResidentFraction}
_DTYPES = {'float32': 'float32', 'fp32': 'float32', 'f32': 'float32',
           'bfloat16': 'bfloat16', 'bf16': 'bfloat16'}


def parse_policy(spec: str) -> dos_jax.Policy:
  """'AllHost', 'Stride(2)', 'DeviceFraction(0.5)', 'ResidentFraction(0.3)' (the rest
  on the host), 'Resident(n)' (any case) -> the policy value."""
  match = re.fullmatch(r'\s*([A-Za-z]+)\s*(?:\(([^)]*)\))?\s*', spec)
  if not match or match.group(1).lower() not in _POLICIES:
    raise argparse.ArgumentTypeError(
        f'unknown policy {spec!r}: one of AllHost, Stride(k), DeviceFraction(f),'
        ' ResidentFraction(f), Resident(n), AllDevice')
  args = [float(a) if '.' in a else int(a)
          for a in (match.group(2) or '').split(',') if a.strip()]
  return _POLICIES[match.group(1).lower()](*args)


def synthetic(num_params: int, dtype):
  """Params and gradients of `num_params` elements in two leaves whose sizes are not
  multiples of any subgroup size, so that packing does real work."""
  sizes = (num_params * 3 // 4 + 7, num_params // 4 - 7)
  keys = jax.random.split(jax.random.key(0), 4)
  params = {f'w{i}': jax.random.normal(k, (n,), dtype) for i, (k, n) in enumerate(zip(keys, sizes))}
  grads = {f'w{i}': jax.random.normal(k, (n,), dtype) * 1e-2
           for i, (k, n) in enumerate(zip(keys[2:], sizes))}
  return params, grads


def time_step(opt, params, grads, reps: int, plan=None, warmup: int = 2,
              early: tuple[int, ...] | None = None) -> dict:
  """Seconds of `opt.init`, of each warm-up step and the median of `reps` timed steps;
  `early`: other early host calls than the state's (`dos_jax.migrate`)."""
  start = time.perf_counter()
  state = jax.block_until_ready(opt.init(params))
  init_s = time.perf_counter() - start
  if early is not None and isinstance(state, dos_jax.OffloadedState):
    state = dos_jax.migrate(state, state.partition.plan, early=early)
  kwargs = {} if plan is None else {'plan': plan}

  def step(p, s, g):
    u, s = opt.update(g, s, p, **kwargs)
    return optax.apply_updates(p, u), s

  # On a GPU the step is compiled as the runner compiles it (`dos_jax.jit`: the
  # latency-hiding scheduler, without which XLA runs the host call and the device update
  # in turn, and both stream lanes grouped with the host call).
  step = dos_jax.jit(step, donate_argnums=(0, 1))
  p = jax.tree.map(jnp.copy, params)
  times = []
  for _ in range(warmup + reps):
    start = time.perf_counter()
    p, state = step(p, state, grads)
    jax.block_until_ready((p, state))
    times.append(time.perf_counter() - start)
  del p, state
  return {'init_s': init_s, 'warmup_s': times[:warmup], 'times_s': times[warmup:],
          'median_s': statistics.median(times[warmup:])}


def _out_of_memory(e: BaseException) -> bool:
  text = f'{type(e).__name__}: {e}'
  return any(s in text for s in ('RESOURCE_EXHAUSTED', 'Out of memory', 'out of memory', 'OOM'))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  number = lambda s: int(float(s))  # 1e9, 100_000_000
  parser.add_argument('--params', type=number, default=100_000_000)
  parser.add_argument('--subgroup-size', type=number, default=10_000_000)
  parser.add_argument('--dtype', choices=sorted(_DTYPES), default='float32')
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--warmup', type=int, default=2,
                      help='untimed steps first (2: the second step compiles again)')
  parser.add_argument('--policies', default=DEFAULT_POLICIES,
                      help=f'comma-separated, in order (default {DEFAULT_POLICIES})')
  parser.add_argument('--no-baseline', action='store_true', help='skip jit(optax.adamw)')
  parser.add_argument('--impl', choices=[i.value for i in dos_jax.UpdateImpl], default='kernel')
  parser.add_argument('--platform', choices=['cpu', 'gpu'], default=None,
                      help="Implementation(program=...); default: the backend's own program")
  parser.add_argument('--mesh', default=None,
                      help="DATAxTENSOR, e.g. 2x2: shard the state over a 'data' axis")
  parser.add_argument('--early', choices=['rule', 'none', 'both'], default='rule',
                      help="the two-memory program's early host calls: the rule's, none"
                      " (one host call), or 'both' to time each in the same run")
  parser.add_argument('--json', default=None, help='write the results here as JSON too')
  return parser


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  specs = [s.strip() for s in re.findall(r'[^,(]+(?:\([^)]*\))?', args.policies) if s.strip()]
  try:
    policies = [parse_policy(s) for s in specs]  # each row is named by its spec: Stride(2)
  except argparse.ArgumentTypeError as e:
    parser.error(str(e))
  dtype = jnp.dtype(_DTYPES[args.dtype])

  mesh = _mesh(args.mesh)
  start = time.perf_counter()
  params, grads = synthetic(args.params, dtype)
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params, grads = jax.device_put((params, grads), replicated)
  jax.block_until_ready((params, grads))

  header = (f'{args.params / 1e6:.0f}M {dtype.name} params, subgroup {args.subgroup_size:,},'
            f' {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}'
            + ('' if mesh is None else f', mesh {dict(mesh.shape)}'))
  print(header)
  print(f'synthetic params and grads: {time.perf_counter() - start:.1f} s')
  record = {'config': {k: v for k, v in vars(args).items()}, 'header': header,
            'backend': jax.default_backend(), 'device_kind': jax.devices()[0].device_kind,
            'jax': jax.__version__, 'rows': []}

  def emit(name: str, row: dict) -> None:
    row = {'name': name, **row}
    baseline = next((r for r in [*record['rows'], row] if r['name'] == 'jit(optax.adamw)'
                     and 'median_s' in r), None)
    if 'median_s' in row:
      ratio = row['median_s'] / baseline['median_s'] if baseline else None
      row['ratio'] = ratio
      print(f'{name:<24} {row["median_s"] * 1e3:9.1f} ms   '
            + ('   n/a' if ratio is None else f'{ratio:5.2f}x')
            + f'   (init {row["init_s"]:.1f} s, warm-up '
            + ', '.join(f'{s:.1f}' for s in row['warmup_s']) + ' s)')
    else:
      print(f'{name:<24} {row["status"]}: {row["error"]}')
    record['rows'].append(row)
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(record, f, indent=1)

  def attempt(name: str, fn) -> None:
    try:
      emit(name, fn())
    except Exception as e:  # pylint: disable=broad-except
      status = 'does not fit' if _out_of_memory(e) else 'error'
      emit(name, {'status': status, 'error': f'{type(e).__name__}: {str(e)[:500]}'})
      if status == 'error':
        traceback.print_exc()

  if not args.no_baseline:
    def baseline():
      master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
      return time_step(optax.adamw(1e-3), master, grads, args.reps, warmup=args.warmup)
    attempt('jit(optax.adamw)', baseline)
  impl = dos_jax.UpdateImpl(args.impl)
  implementation = dos_jax.Implementation(program=args.platform, device=impl, host=impl)
  forms = {'rule': [None], 'none': [()], 'both': [None, ()]}[args.early]
  for spec, policy in zip(specs, policies):
    for early in forms:
      offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=policy, mesh=mesh)
      name = spec
      if len(forms) > 1:
        name += ' one host call' if early == () else ' early calls'
      attempt(name, lambda offload=offload, early=early: time_step(
          dos_jax.adamw(1e-3, offload=offload, implementation=implementation), params,
          grads, args.reps, warmup=args.warmup, early=early))

  return _summary(record['rows'], specs, policies)


def _mesh(spec: str | None):
  """`--mesh DATAxTENSOR` as a ('data', 'tensor') mesh; None without one."""
  if not spec:
    return None
  data, tensor = (int(n) for n in spec.lower().split('x'))
  if jax.default_backend() == 'cpu' and len(jax.devices()) < data * tensor:
    raise SystemExit(f'--mesh {spec} needs {data * tensor} devices: run with '
                     f'XLA_FLAGS=--xla_force_host_platform_device_count={data * tensor}')
  return jax.sharding.Mesh(
      np.array(jax.devices()[:data * tensor]).reshape(data, tensor), ('data', 'tensor'))


def _summary(rows, specs, policies) -> int:
  """Prints the SUMMARY line; 1 if a row failed. Not fitting is a result for the
  baselines (optax, AllDevice), a failure for the rest."""
  may_not_fit = {'jit(optax.adamw)'} | {
      spec for spec, policy in zip(specs, policies) if isinstance(policy, dos_jax.AllDevice)}
  failed = [r['name'] for r in rows if r.get('status') == 'error' or (
      r.get('status') == 'does not fit' and r['name'] not in may_not_fit)]
  print('SUMMARY ' + '; '.join(
      f'{r["name"]} {r["median_s"] * 1e3:.4g} ms'
      + ('' if r.get('ratio') is None else f' {r["ratio"]:.2f}x')
      if 'median_s' in r else f'{r["name"]} {r["status"]}' for r in rows))
  return 1 if failed else 0


if __name__ == '__main__':
  raise SystemExit(main())
