"""Compile the runner's step (or the library's update) for a GPU target, with no GPU.

Builds the runner's real one-program step from a run config (forward, backward, global
norm, the dos_jax update with the clip factor as grad_scale, apply; the accelerator
program) or the library's update alone (`--program update`: `opt.update` +
`optax.apply_updates` on an MLP), compiles it with the CUDA plugin's compile-only client
for an H100 or H200, and reports what the schedule does:

  gradient_copies, gradient_copies_overlapping_compute   weight-gradient copies to host
                                           and how many have device compute in flight
  device_update_inside_host_call          device update work issued between the host
                                           call's start and done
  large_host_to_host_copies (+ _bytes)    host->host copies of 1 MiB or more
  memory                                  device / host argument, output, alias, temp bytes
  compile_s                               the XLA compile time

Needs Python >= 3.12 with `pip install "jax[cuda13]==0.11.2"` (the GPU machines'
version) and the project installed; runs on CPU (it sets JAX_PLATFORMS=cpu).

  python experiments/compile_gpu.py --target h100_sxm --policy stride --json out.json
  python experiments/compile_gpu.py --target h200 --policy device_fraction --dtype float32
  python experiments/compile_gpu.py --program update --policy stride --default-schedule

On a machine with a GPU, `--run N` instead compiles the runner's step for that GPU through
JAX (with the options the runner uses there), reports the same schedule facts from the
program the GPU runs, and times N steps on random tokens (median step time, tokens/s).
On a CPU it runs the accelerator program on the CPU backend (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # XLA's stack-frame warnings

POLICIES = ('all_host', 'stride', 'device_fraction', 'all_device', 'auto')


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--target', default='h100_sxm', help='h100_sxm (h100) or h200')
  parser.add_argument('--program', choices=('step', 'update'), default='step',
                      help="the runner's one-program step, or the library's update alone")
  parser.add_argument('--config', default=None,
                      help='run config YAML (default: the packaged tiny config)')
  parser.add_argument('--set', dest='overrides', action='append', default=[],
                      metavar='KEY=VALUE', help='config override, as for dos-jax train')
  parser.add_argument('--policy', choices=POLICIES, default='stride')
  parser.add_argument('--dtype', choices=('bfloat16', 'float32'), default='bfloat16',
                      help='parameter dtype (bf16 params keep an fp32 master)')
  parser.add_argument('--storage', choices=('stacked', 'per_subgroup'), default=None)
  parser.add_argument('--subgroup-size', type=int, default=65536)
  parser.add_argument('--no-clip', action='store_true',
                      help='no global-norm clipping (default: clip at 1.0)')
  parser.add_argument('--default-schedule', action='store_true',
                      help="XLA's default options instead of dos_jax.GPU_COMPILER_OPTIONS")
  parser.add_argument('--json', default=None, help='write the report here')
  parser.add_argument('--hlo', default=None, help='write the scheduled HLO here')
  parser.add_argument('--run', type=int, default=0, metavar='N',
                      help="compile for this machine's backend and time N steps")
  return parser.parse_args(argv)


def _config(args):
  from dos_jax.train import config as config_lib
  overrides = [f'offload.policy={args.policy}', f'model.param_dtype={args.dtype}',
               f'offload.subgroup_size={args.subgroup_size}',
               f'optim.clip_norm={"null" if args.no_clip else 1.0}']
  if args.storage:
    overrides.append(f'offload.storage={args.storage}')
  return config_lib.load(args.config, overrides + args.overrides)


def _update_program(cfg, target, options):
  """The library's update (`opt.update` + `apply_updates`) on an 8-layer MLP."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import dos_jax
  from dos_jax import dataflow
  from dos_jax.train import step as step_lib
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(cfg.model.param_dtype)
  params = {f'layer{i}': {'w': jnp.asarray(rng.standard_normal((512, 512)) / 23, dtype),
                          'b': jnp.zeros((512,), dtype)} for i in range(8)}
  offload = step_lib.make_offload(cfg.offload, dos_jax.Platform.GPU)
  opt = dos_jax.adamw(1e-3, weight_decay=0.1, offload=offload)
  if cfg.optim.clip_norm is not None:
    opt = dos_jax.chain(dos_jax.clip_by_global_norm(cfg.optim.clip_norm), opt)
  native = dataflow.compile.prepare(target)
  state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  lowered = dataflow.lower_for_gpu(step, params, state, grads, target=target,
                                   donate_argnums=(0, 1))
  return dataflow.compile_lowered(lowered, target, options, native_host_kernel=native)


def _run_here(args, cfg) -> dict:
  """The runner's step compiled by JAX for this machine's backend, its schedule facts
  (GPU only) and the median time of `args.run` steps on random tokens."""
  import jax
  import numpy as np
  from dos_jax.dataflow.schedule import Schedule
  from dos_jax.train import gpu_program
  from dos_jax.train import step as step_lib
  backend = jax.default_backend()
  options = None if args.default_schedule else step_lib.compiler_options_for(backend)
  program = gpu_program.build_step(cfg, compiler_options=options)
  rng = np.random.default_rng(0)
  vocab = cfg.model.shape().vocab_size

  def tokens():
    return jax.numpy.asarray(rng.integers(0, vocab, program.tokens.shape), jax.numpy.int32)

  start = time.perf_counter()
  compiled = program.step.lower(program.params, program.opt_state, tokens(),
                                plan=None).compile()
  compile_s = time.perf_counter() - start
  facts = {}
  if backend == 'gpu':
    facts = Schedule.from_text(compiled.as_text()).summary()
    facts.pop('device_work_inside_host_call', None)
  params, opt_state, times = program.params, program.opt_state, []
  for i in range(args.run + 1):
    batch = tokens()
    t0 = time.perf_counter()
    params, opt_state, stats = compiled(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, stats))
    if i:  # the first step warms up
      times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  batch_tokens = cfg.data.batch_size * cfg.data.seq_len
  return {'backend': backend, 'device': jax.devices()[0].device_kind,
          'compile_s': round(compile_s, 3), 'steps': args.run,
          'median_step_s': round(step_s, 6), 'tokens_per_s': round(batch_tokens / step_s, 1),
          'loss': float(stats['loss']), **facts}


def main(argv=None) -> int:
  args = _parse(argv)
  if not args.run:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile-only: no GPU is looked for
  import jax
  from dos_jax import dataflow
  from dos_jax.train import gpu_program
  try:
    target = dataflow.GpuTarget.parse(args.target)
  except ValueError as e:
    print(f'compile_gpu: error: {e}', file=sys.stderr)
    return 2
  if args.run:
    if args.run < 1:
      print('compile_gpu: error: --run needs a positive number of steps', file=sys.stderr)
      return 2
    report = {'policy': args.policy, 'dtype': args.dtype, 'jax': jax.__version__,
              **_run_here(args, _config(args))}
    if args.json:
      with open(args.json, 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1)
    print(f'SUMMARY {args.policy} {args.dtype} step on {report["device"]} '
          f'({report["backend"]}): median {report["median_step_s"] * 1e3:.2f} ms over '
          f'{args.run} steps, {report["tokens_per_s"]:.0f} tokens/s, compiled in '
          f'{report["compile_s"]:.1f} s'
          + (f'; gradient copies overlapping compute '
             f'{report["gradient_copies_overlapping_compute"]}/{report["gradient_copies"]},'
             f' device update inside host call {report["device_update_inside_host_call"]}'
             if 'gradient_copies' in report else ''))
    return 0
  available, why = dataflow.gpu_compiler_available()
  if not available:
    print(f'compile_gpu: error: {why}', file=sys.stderr)
    return 2
  cfg = _config(args)
  options = {} if args.default_schedule else dict(dataflow.GPU_COMPILER_OPTIONS)
  start = time.perf_counter()
  if args.program == 'step':
    program = gpu_program.compile_step(cfg, target, compiler_options=options)
  else:
    program = _update_program(cfg, target, options)
  wall_s = time.perf_counter() - start
  summary = program.schedule.summary()
  report = {
      'target': target.value, 'program': args.program, 'policy': args.policy,
      'dtype': args.dtype, 'storage': args.storage, 'clip': not args.no_clip,
      'subgroup_size': args.subgroup_size, 'compiler_options': options,
      'model': cfg.model.preset, 'jax': jax.__version__,
      'native_host_kernel': program.native_host_kernel,
      'compile_s': round(program.compile_s, 3), 'build_and_compile_s': round(wall_s, 3),
      'memory': dataclasses.asdict(program.memory),
      **{k: v for k, v in summary.items() if k != 'device_work_inside_host_call'},
  }
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=1)
  if args.hlo:
    with open(args.hlo, 'w', encoding='utf-8') as f:
      f.write(program.hlo_text)
  mib = lambda b: f'{b / 2**20:.1f} MiB'
  m = program.memory
  print(f'SUMMARY {args.program} {args.policy} {args.dtype} on {target.value} '
        f'(jax {jax.__version__}, {"default" if args.default_schedule else "dos_jax"} '
        f'schedule): compiled in {program.compile_s:.1f} s')
  print(f'  gradient copies overlapping compute: '
        f'{summary["gradient_copies_overlapping_compute"]} of {summary["gradient_copies"]}')
  print(f'  device update inside the host call: {summary["device_update_inside_host_call"]}')
  print(f'  large host->host copies: {summary["large_host_to_host_copies"]} '
        f'({mib(summary["large_host_to_host_copy_bytes"])})')
  print(f'  device: arguments {mib(m.argument_bytes)}, temp {mib(m.temp_bytes)}, outputs '
        f'{mib(m.output_bytes)}; host: arguments {mib(m.host_argument_bytes)}, temp '
        f'{mib(m.host_temp_bytes)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
