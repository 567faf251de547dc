"""The host AdamW against DeepSpeedCPUAdam, and the whole CPU step against optax, in one run.

Five sections, each timed in alternating rounds (one run of every case per round, a
median over `--reps` rounds after `--warmup`), so that load from other processes falls
on every case alike, and every ratio is taken against a baseline of the same run:

  kernel  `dos_jax.kernels.adamw_host_rows` on a donated (G, 3, S) fp32 state, bf16
          gradient rows in, bf16 parameter rows out (into a fresh buffer, as XLA gives
          one per call, and into a donated one), against DeepSpeedCPUAdam's step plus
          the fp32 -> bf16 cast of its params.
  isa     the same call (donated out) per instruction set, at 1 and 2 threads.
  bandwidth  experiments/traffic_probe.c (compiled here with cc -O3 -march=native
          -fopenmp): the kernel's 28 bytes per element with trivial arithmetic, the
          bound the machine's memory sets; with the kernel section, the fraction of it
          the kernel (donated out) reaches.
  step    the whole jitted CPU step (dos_jax.adamw update + optax.apply_updates,
          donated, AllHost) for fp32 and bf16 params, against DeepSpeedCPUAdam (bf16:
          plus the cast) and jit(optax.adamw) on fp32 params.
  mlp     an 8M-parameter MLP train step (value_and_grad -> update -> apply_updates,
          donated), dos_jax.adamw under AllHost, Stride(2), AllDevice against
          optax.adamw, for fp32 and bf16 params. optax on bf16 params keeps bf16 moments;
          the row "optax fp32 master" is optax on an fp32 copy cast to bf16 for the
          forward, the same arithmetic as dos_jax's fp32 master.

DeepSpeed comes with the `bench` extra (pip install -e ".[bench]": torch 2.13.0 CPU and
deepspeed; the first use JIT-builds its CPU Adam op with ninja, about 2 minutes). Without
it the DeepSpeed rows are skipped. Threads: `--threads` for our kernel, and torch's and
OpenMP's threads for DeepSpeed (set OMP_NUM_THREADS before torch loads: done here).

  python experiments/bench_host.py --out /tmp/bench_host.json
  python experiments/bench_host.py --sections kernel --params 64e6 --reps 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Callable

number = lambda s: int(float(s))  # 64e6, 64_000_000


def _args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sections', default='kernel,isa,bandwidth,step,mlp')
  parser.add_argument('--params', type=number, default=64_000_000,
                      help='elements of the kernel and step sections')
  parser.add_argument('--subgroup-size', type=number, default=8_000_000)
  parser.add_argument('--mlp-subgroup-size', type=number, default=3_000_000)
  parser.add_argument('--mlp-width', type=int, default=2000)
  parser.add_argument('--mlp-layers', type=int, default=2)
  parser.add_argument('--mlp-batch', type=int, default=500)
  parser.add_argument('--threads', type=int, default=2)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--out', default=None, help='write the results as JSON here')
  parser.add_argument(
      '--no-keep-freed-memory', dest='keep_freed_memory', action='store_false',
      help="leave glibc's allocator as it is: every large output faults in and zeroes"
      " fresh pages (by default the process keeps freed memory, as dos-jax train does;"
      ' see dos_jax.host_memory)')
  return parser.parse_args(argv)


ARGS = _args() if __name__ == '__main__' else None
if ARGS is not None:
  os.environ.setdefault('OMP_NUM_THREADS', str(ARGS.threads))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

import dos_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from dos_jax import kernels  # pylint: disable=g-import-not-at-top,wrong-import-position


def alternate(cases: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict:
  """Median wall and process-CPU seconds of each case; every round runs each case once,
  in turn. CPU time is the steadier figure on a loaded machine (time spent waiting for
  a core is not counted), but counts threads that spin while idle (OpenMP's, XLA's)."""
  times = {name: [] for name in cases}
  cpu = {name: [] for name in cases}
  for round_ in range(warmup + reps):
    for name, run in cases.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      run()
      if round_ >= warmup:
        times[name].append(time.perf_counter() - start)
        cpu[name].append(time.process_time() - start_cpu)
  return {name: {'median_s': statistics.median(t), 'times_s': t,
                 'cpu_median_s': statistics.median(cpu[name])} for name, t in times.items()}


class Carry:
  """A donated jitted function and its live carried arguments."""

  def __init__(self, fn, carry, consts=()):
    self.fn, self.carry, self.consts = fn, carry, consts

  def __call__(self) -> None:
    self.carry = self.fn(*self.carry, *self.consts)
    jax.block_until_ready(self.carry)


def deepspeed_case(n: int, threads: int, cast: bool):
  """DeepSpeedCPUAdam's step (plus the fp32 -> bf16 cast of params when `cast`), or None."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  torch.set_num_threads(threads)
  param = torch.nn.Parameter(torch.randn(n))
  param.grad = torch.randn(n) * 1e-2
  opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=1e-4, adamw_mode=True)
  lowp = torch.empty(n, dtype=torch.bfloat16)

  def run():
    opt.step()
    if cast:
      with torch.no_grad():
        lowp.copy_(param)
  return run


SCALARS = kernels.AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                               weight_decay=1e-4, bc1=0.1, bc2=0.001)


def kernel_inputs(args, seed: int):
  """`(groups, size, elements, bf16 gradient rows)` of the kernel sections."""
  size = args.subgroup_size
  groups = -(-args.params // size)
  rng = np.random.default_rng(seed)
  grads = jnp.asarray(rng.standard_normal((groups, size), np.float32) * 1e-2, jnp.bfloat16)
  return groups, size, groups * size, grads


def rows_call(groups: int, threads: int, **isa):
  """The kernel as the core calls it on every row: `(state, grads, None, out=)`."""
  return functools.partial(
      kernels.adamw_host_rows, rows=jnp.arange(groups, dtype=jnp.int32), scalars=SCALARS,
      slots=(0, 1, 2), decayed_rows=groups, lowp_dtype=jnp.bfloat16, indexed=True,
      num_threads=threads, **isa)


def kernel_section(args) -> dict:
  groups, size, n, grads = kernel_inputs(args, 0)
  rng = np.random.default_rng(2)
  call = rows_call(groups, args.threads)
  fresh = jax.jit(lambda st, g: call(st, g, None), donate_argnums=(0,))
  into = jax.jit(lambda st, out, g: call(st, g, None, out=out), donate_argnums=(0, 1))

  def state():
    return jnp.stack([jnp.asarray(rng.standard_normal((groups, size), np.float32)),
                      jnp.zeros((groups, size)), jnp.zeros((groups, size))], axis=1)

  cases = {
      'dos_jax rows, fresh out': Carry(lambda st, _: fresh(st, grads), (state(), None)),
      'dos_jax rows, donated out': Carry(
          into, (state(), jnp.zeros((groups, size), jnp.bfloat16)), (grads,)),
  }
  ds = deepspeed_case(n, args.threads, cast=True)
  if ds is not None:
    cases['DeepSpeedCPUAdam + bf16 cast'] = ds
  result = alternate(cases, args.reps, args.warmup)
  for r in result.values():
    r['gparam_s'] = n / r['median_s'] / 1e9
  return {'elements': n, 'subgroups': groups, 'cases': result}


# Bytes the kernel moves per element with a donated out: 2 (bf16 grad) + 12 (state
# read) + 12 (state written) + 2 (bf16 params out).
KERNEL_BYTES_PER_ELEMENT = 28


def bandwidth_section(args) -> dict | None:
  """Seconds per pass of traffic_probe.c over `--params` elements at `--threads`
  threads (median of `--reps` after one warm-up pass), or None without a C compiler."""
  cc = shutil.which('cc') or shutil.which('gcc')
  if cc is None:
    return None
  source = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'traffic_probe.c')
  with tempfile.TemporaryDirectory() as tmp:
    exe = os.path.join(tmp, 'probe')
    subprocess.run([cc, '-O3', '-march=native', '-fopenmp', source, '-o', exe], check=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    lines = subprocess.run([exe, str(args.params), str(args.reps + 1)], env=env, check=True,
                           capture_output=True, text=True).stdout.split()
  seconds = statistics.median(float(x) for x in lines[1:])
  return {'elements': args.params, 'threads': args.threads, 'median_s': seconds,
          'gbps': args.params * KERNEL_BYTES_PER_ELEMENT / seconds / 1e9}


def isa_section(args) -> dict:
  """The kernel (donated out) per instruction set and thread count, Gparam/s."""
  groups, size, n, grads = kernel_inputs(args, 1)
  cases = {}
  for isa in kernels.supported_isas():
    for threads in (1, 2):
      call = rows_call(groups, threads, isa=isa)
      fn = jax.jit(lambda st, out, g, call=call: call(st, g, None, out=out),
                   donate_argnums=(0, 1))
      state = jnp.zeros((groups, 3, size), jnp.float32)
      cases[f'{isa.name}, {threads} thread(s)'] = Carry(
          fn, (state, jnp.zeros((groups, size), jnp.bfloat16)), (grads,))
  result = alternate(cases, args.reps, 1)
  for r in result.values():
    r['gparam_s'] = n / r['median_s'] / 1e9
  return {'elements': n, 'cases': result}


def step_runner(opt, params, grads, plan=None):
  kwargs = {} if plan is None else {'plan': plan}

  def step(p, s, g):
    u, s = opt.update(g, s, p, **kwargs)
    return optax.apply_updates(p, u), s

  return Carry(jax.jit(step, donate_argnums=(0, 1)),
               (jax.tree.map(jnp.copy, params), opt.init(params)), (grads,))


def step_section(args) -> dict:
  n = args.params
  key = jax.random.key(0)
  p32 = {'w': jax.random.normal(key, (n,), jnp.float32)}
  g32 = {'w': jax.random.normal(jax.random.key(1), (n,), jnp.float32) * 1e-2}
  offload = dos_jax.Offload(subgroup_size=args.subgroup_size, policy=dos_jax.AllHost(),
                            host_threads=args.threads)
  opt = dos_jax.adamw(1e-3, weight_decay=1e-4, offload=offload)
  cases = {
      'dos_jax fp32 params': step_runner(opt, p32, g32),
      'dos_jax bf16 params': step_runner(
          opt, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32),
          jax.tree.map(lambda x: x.astype(jnp.bfloat16), g32)),
      'jit(optax.adamw) fp32': step_runner(optax.adamw(1e-3, weight_decay=1e-4), p32, g32),
  }
  for cast in (False, True):
    ds = deepspeed_case(n, args.threads, cast=cast)
    if ds is not None:
      cases['DeepSpeedCPUAdam' + (' + bf16 cast' if cast else '')] = ds
  result = alternate(cases, args.reps, args.warmup)
  for r in result.values():
    r['gparam_s'] = n / r['median_s'] / 1e9
  return {'elements': n, 'cases': result}


def mlp_params(args, dtype):
  keys = jax.random.split(jax.random.key(2), args.mlp_layers)
  w = args.mlp_width
  return [{'w': (jax.random.normal(k, (w, w), jnp.float32) / np.sqrt(w)).astype(dtype),
           'b': jnp.zeros((w,), dtype)} for k in keys]


def mlp_loss(params, x, y):
  h = x
  for i, layer in enumerate(params):
    h = h @ layer['w'] + layer['b']
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def mlp_runner(opt, params, batch, plan=None, master=False):
  """A donated train step; `master`: optax on an fp32 copy, the forward on its cast."""
  kwargs = {} if plan is None else {'plan': plan}
  dtype = jax.tree.leaves(params)[0].dtype

  def step(p, s, x, y):
    fwd = jax.tree.map(lambda a: a.astype(dtype), p) if master else p
    _, g = jax.value_and_grad(mlp_loss)(fwd, x, y)
    u, s = opt.update(g, s, p, **kwargs)
    return optax.apply_updates(p, u), s

  p = jax.tree.map(lambda a: a.astype(jnp.float32), params) if master else params
  return Carry(jax.jit(step, donate_argnums=(0, 1)),
               (jax.tree.map(jnp.copy, p), opt.init(p)), batch)


def mlp_section(args) -> dict:
  rng = np.random.default_rng(3)
  w = args.mlp_width
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    params = mlp_params(args, dtype)
    n = sum(x.size for x in jax.tree.leaves(params))
    batch = (jnp.asarray(rng.standard_normal((args.mlp_batch, w)), dtype),
             jnp.asarray(rng.standard_normal((args.mlp_batch, w)), jnp.float32))
    base = optax.adamw(1e-3, weight_decay=1e-4)
    cases = {'optax.adamw': mlp_runner(base, params, batch)}
    if dtype != jnp.float32:
      cases['optax.adamw fp32 master'] = mlp_runner(base, params, batch, master=True)
    for name, policy in (('AllHost', dos_jax.AllHost()), ('Stride(2)', dos_jax.Stride(2)),
                         ('AllDevice', dos_jax.AllDevice())):
      offload = dos_jax.Offload(subgroup_size=args.mlp_subgroup_size, policy=policy,
                                host_threads=args.threads)
      cases[f'dos_jax {name}'] = mlp_runner(
          dos_jax.adamw(1e-3, weight_decay=1e-4, offload=offload), params, batch)
    result = alternate(cases, args.reps, args.warmup)
    ref = result['optax.adamw']['median_s']
    for r in result.values():
      r['vs_optax'] = r['median_s'] / ref
    out[jnp.dtype(dtype).name] = {'elements': n, 'cases': result}
  return out


def machine() -> dict:
  model = ''
  try:
    with open('/proc/cpuinfo') as f:
      model = next(l.split(':', 1)[1].strip() for l in f if l.startswith('model name'))
  except (OSError, StopIteration):
    pass
  return {'cpu': model or platform.processor(), 'cores': os.cpu_count(),
          'isas': [i.name for i in kernels.supported_isas()], 'jax': jax.__version__,
          'date_utc': time.strftime('%Y-%m-%d %H:%M', time.gmtime()),
          'loadavg': os.getloadavg()}


def _print(title: str, cases: dict, ref: str | None, key: str = 'gparam_s') -> None:
  print(f'\n{title}')
  base = cases.get(ref, {}).get('median_s') if ref else None
  for name, r in cases.items():
    extra = f'  {r[key]:6.3f} Gparam/s' if key in r else ''
    ratio = f'  {base / r["median_s"]:5.2f}x speed of {ref}' if base else ''
    print(f'  {name:<34} {r["median_s"] * 1e3:8.1f} ms (cpu {r["cpu_median_s"] * 1e3:7.1f})'
          f'{extra}{ratio}')


def main(args) -> None:
  if args.keep_freed_memory:
    dos_jax.keep_freed_host_memory()
  results = {'machine': machine(), 'args': vars(args)}
  print(results['machine'])
  sections = [s.strip() for s in args.sections.split(',') if s.strip()]
  if 'kernel' in sections:
    results['kernel'] = kernel_section(args)
    _print(f'kernel: {results["kernel"]["elements"] / 1e6:.0f}M, {args.threads} threads, '
           'bf16 grads in, bf16 params out', results['kernel']['cases'],
           'DeepSpeedCPUAdam + bf16 cast')
  if 'isa' in sections:
    results['isa'] = isa_section(args)
    _print('kernel per instruction set (donated out)', results['isa']['cases'], None)
  if 'bandwidth' in sections:
    results['bandwidth'] = probe = bandwidth_section(args)
    if probe is None:
      print('\nbandwidth: no C compiler (cc/gcc) found, skipped')
    else:
      print(f'\nmemory traffic probe, {probe["elements"] / 1e6:.0f}M x'
            f' {KERNEL_BYTES_PER_ELEMENT} B, {probe["threads"]} threads:'
            f' {probe["median_s"] * 1e3:.1f} ms, {probe["gbps"]:.1f} GB/s')
      if 'kernel' in results:
        kernel = results['kernel']
        t = kernel['cases']['dos_jax rows, donated out']['median_s']
        gbps = kernel['elements'] * KERNEL_BYTES_PER_ELEMENT / t / 1e9
        kernel['donated_gbps'] = gbps
        print(f'  kernel, donated out: {gbps:.1f} GB/s, {gbps / probe["gbps"]:.0%} of the probe'
              ' (same elements only when --subgroup-size divides --params)')
  if 'step' in sections:
    results['step'] = step_section(args)
    cases = results['step']['cases']
    _print(f'whole jitted CPU step, {args.params / 1e6:.0f}M, AllHost', cases,
           'DeepSpeedCPUAdam')
    if 'DeepSpeedCPUAdam + bf16 cast' in cases:
      r = cases['DeepSpeedCPUAdam + bf16 cast']['median_s']
      print(f'  bf16 params vs DeepSpeed + cast: '
            f'{r / cases["dos_jax bf16 params"]["median_s"]:.2f}x speed')
  if 'mlp' in sections:
    results['mlp'] = mlp_section(args)
    for dtype, r in results['mlp'].items():
      print(f'\nMLP train step, {r["elements"] / 1e6:.1f}M {dtype} params '
            f'(time ratio to optax.adamw; goal <= 1.10)')
      for name, c in r['cases'].items():
        print(f'  {name:<34} {c["median_s"] * 1e3:8.1f} ms (cpu {c["cpu_median_s"] * 1e3:7.1f})'
              f'  {c["vs_optax"]:5.2f}x')
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main(ARGS)
