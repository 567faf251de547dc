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
  host_calls, host_calls_starting_before_last_gemm
                                           the host calls (early ones included) and how
                                           many start during the backward pass
  device_updates_outside_host_calls       device updates no host call runs beside
  streamed_fetches_after_previous_write_back
                                           fetches that wait for a write-back (0: full
                                           duplex)
  large_host_to_host_copies (+ _bytes)    host->host copies of 1 MiB or more
  memory                                  device / host argument, output, alias, temp bytes
  compile_s                               the XLA compile time

Needs Python >= 3.12 with `pip install "jax[cuda13]==0.11.2"` (the GPU machines'
version) and the project installed; runs on CPU (it sets JAX_PLATFORMS=cpu).

  python experiments/compile_gpu.py --target h100_sxm --policy stride --json out.json
  python experiments/compile_gpu.py --target h200 --policy device_fraction --dtype float32
  python experiments/compile_gpu.py --program update --policy stride --default-schedule
  python experiments/compile_gpu.py --config configs/paper/20b.yaml --devices 4 \
      --extrapolate 2,4 --json out.json

`--devices N` compiles the step over the config's mesh of N GPUs (ZeRO-3 over `fsdp`
included), one SPMD partition each, from abstract arguments (nothing is allocated, so a
20B model needs no 20B of memory here); `device_peak_bytes` is then one GPU's.
`--extrapolate A,B` compiles A and B layers of the config's shape instead of all of them
and extends the device peak linearly per layer to the config's depth (both points are
in the report). With `--config`, the policy, dtype and subgroup size are the config's
unless given.

On a machine with a GPU, `--run N` instead compiles the runner's step for that GPU through
JAX (with the options the runner uses there), reports the same schedule facts from the
program the GPU runs, and times N steps on random tokens (median step time, tokens/s).
On a CPU it runs the two-memory program on the CPU backend (a smoke test).

`--early none` builds the step with one host call (no early host calls: the state
migrated with `dos_jax.migrate(..., early=())`) instead of the builder's choice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

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
  parser.add_argument('--policy', choices=POLICIES, default=None,
                      help='default: the config\'s, else stride')
  parser.add_argument('--dtype', choices=('bfloat16', 'float32'), default=None,
                      help='parameter dtype (bf16 params keep an fp32 master); default: the'
                      ' config\'s, else bfloat16')
  parser.add_argument('--early', choices=('default', 'none'), default='default',
                      help="the step's early host calls: as the runner's builder chose them,"
                      " or none (one host call: dos_jax.migrate(..., early=()))")
  parser.add_argument('--subgroup-size', type=int, default=None,
                      help='default: the config\'s, else 65536')
  parser.add_argument('--devices', type=int, default=1,
                      help='GPUs of the mesh (the config\'s mesh axes must fit them)')
  parser.add_argument('--extrapolate', default=None, metavar='A,B',
                      help='compile A and B layers and extrapolate the peak per layer')
  parser.add_argument('--no-clip', action='store_true',
                      help='no global-norm clipping (default: clip at 1.0)')
  parser.add_argument('--default-schedule', action='store_true',
                      help="XLA's default options instead of dos_jax.GPU_COMPILER_OPTIONS")
  parser.add_argument('--json', default=None, help='write the report here')
  parser.add_argument('--hlo', default=None, help='write the scheduled HLO here')
  parser.add_argument('--run', type=int, default=0, metavar='N',
                      help="compile for this machine's backend and time N steps")
  return parser.parse_args(argv)


def _config(args, extra=()):
  from dos_jax.train import config as config_lib
  given = args.config is not None  # a config's own settings stand unless a flag is given
  defaults = {'policy': None if given else 'stride', 'dtype': None if given else 'bfloat16',
              'subgroup_size': None if given else 65536}
  pick = lambda name: getattr(args, name) or defaults[name]
  overrides = []
  if pick('policy'):
    overrides.append(f'offload.policy={pick("policy")}')
  if pick('dtype'):
    overrides.append(f'model.param_dtype={pick("dtype")}')
  if pick('subgroup_size'):
    overrides.append(f'offload.subgroup_size={pick("subgroup_size")}')
  if args.no_clip or not given:
    overrides.append(f'optim.clip_norm={"null" if args.no_clip else 1.0}')
  return config_lib.load(args.config, overrides + args.overrides + list(extra))


def _one_host_call(opt_state):
  """`opt_state` with no early host calls (`--early none`)."""
  import jax
  import dos_jax
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  for state in jax.tree.leaves(opt_state, is_leaf=is_state):
    if is_state(state):
      opt_state = dos_jax.migrate(opt_state, state.partition.plan, early=())
  return opt_state


def _compile_step(args, cfg, target, options, devices=None):
  """The runner's step for `cfg` compiled for `target` (`gpu_program.compile_step`),
  with one host call under `--early none`."""
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow
  from tests.tooling import gpu_program
  if args.early == 'default':
    return gpu_program.compile_step(cfg, target, compiler_options=options, devices=devices)
  native = dataflow.compile.prepare(target)
  program = gpu_program.build_step(cfg, devices)
  with dos_jax.compiled_with(options):  # the step traced told their limit
    lowered = dataflow.lower_for_gpu(
        program.step, program.params, _one_host_call(program.opt_state), program.tokens,
        target=dataflow.GpuTarget.parse(target), kwargs={'plan': None})
  return dataflow.compile_lowered(lowered, target, options, native_host_kernel=native)


def _sharded(args, target, options) -> dict:
  """`--devices N`: the step over the config's mesh of N GPUs, all layers or
  `--extrapolate A,B` layers extended linearly to the config's depth."""
  import jax
  from dos_jax.planner import step_memory
  devices = jax.devices()[:args.devices]
  if len(devices) < args.devices:
    raise ValueError(f'--devices {args.devices}: only {len(devices)} CPU devices')
  cfg = _config(args)
  depth = cfg.model.shape().n_layers
  counts = [depth] if not args.extrapolate else [int(x) for x in args.extrapolate.split(',')]
  points = []
  for layers in counts:
    layer_cfg = _config(args, [f'model.n_layers={layers}'])
    start = time.perf_counter()
    program = _compile_step(args, layer_cfg, target, options, devices)
    points.append({'layers': layers, 'compile_s': round(program.compile_s, 1),
                   'build_and_compile_s': round(time.perf_counter() - start, 1),
                   'device_peak_bytes': program.memory.device_peak_bytes,
                   'memory': dataclasses.asdict(program.memory),
                   'predicted_device_bytes': step_memory.predict_step(
                       layer_cfg, devices=args.devices).device_bytes,
                   **{k: v for k, v in program.schedule.summary().items()
                      if k != 'device_work_inside_host_call'}})
    print(f'compiled {layers} layers over {args.devices} GPUs: peak'
          f' {points[-1]["device_peak_bytes"] / 2**30:.2f} GiB per GPU in'
          f' {points[-1]["build_and_compile_s"]:.0f} s', file=sys.stderr, flush=True)
  if len(points) == 1:
    peak = points[0]['device_peak_bytes']
    how = 'compiled'
  else:
    (a, pa), (b, pb) = [(p['layers'], p['device_peak_bytes']) for p in points[:2]]
    peak = pa + (depth - a) * (pb - pa) / (b - a)
    how = f'extrapolated per layer from {a} and {b} layers'
  predicted = step_memory.predict_step(cfg, devices=args.devices).device_bytes
  return {'devices': args.devices, 'layers': depth, 'device_peak_bytes': int(peak),
          'device_peak_how': how, 'predicted_device_bytes': int(predicted),
          'predicted_over_compiled': round(predicted / peak, 3), 'points': points}


def _update_program(cfg, target, options):
  """The library's update (`opt.update` + `apply_updates`) on an 8-layer MLP."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import dos_jax
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow
  from dos_jax.train import step as step_lib
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(cfg.model.param_dtype)
  params = {f'layer{i}': {'w': jnp.asarray(rng.standard_normal((512, 512)) / 23, dtype),
                          'b': jnp.zeros((512,), dtype)} for i in range(8)}
  opt = dos_jax.adamw(
      1e-3, weight_decay=0.1, offload=step_lib.make_offload(cfg.offload),
      implementation=step_lib.make_implementation(cfg.offload, dos_jax.Program.TWO_MEMORIES))
  if cfg.optim.clip_norm is not None:
    opt = dos_jax.chain(dos_jax.clip_by_global_norm(cfg.optim.clip_norm), opt)
  native = dataflow.compile.prepare(target)
  state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  with dos_jax.compiled_with(options):  # the step traced told their limit
    lowered = dataflow.lower_for_gpu(step, params, state, grads, target=target,
                                     donate_argnums=(0, 1))
  return dataflow.compile_lowered(lowered, target, options, native_host_kernel=native)


def _run_here(args, cfg) -> dict:
  """The runner's step compiled by JAX for this machine's backend, its schedule facts
  (GPU only) and the median time of `args.run` steps on random tokens."""
  import jax
  import numpy as np
  from dos_jax.dataflow import early_windows
  from dos_jax.dataflow.schedule import Schedule
  from tests.tooling import gpu_program
  from dos_jax.train import step as step_lib
  backend = jax.default_backend()
  options = None if args.default_schedule else step_lib.compiler_options_for(backend)
  program = gpu_program.build_step(cfg, compiler_options=options, platform=backend)
  opt_state = program.opt_state if args.early == 'default' else _one_host_call(program.opt_state)
  rng = np.random.default_rng(0)
  vocab = cfg.model.shape().vocab_size

  def tokens():
    return jax.numpy.asarray(rng.integers(0, vocab, program.tokens.shape), jax.numpy.int32)

  start = time.perf_counter()
  lowered = program.step.lower(program.params, opt_state, tokens(), plan=None)
  # As the runner compiles on a GPU: early host calls with their profiled latency.
  compiled = lowered.compile() if args.default_schedule else early_windows.compile_step(lowered)
  compile_s = time.perf_counter() - start
  facts = {}
  if backend == 'gpu':
    facts = Schedule.from_text(compiled.as_text()).summary()
    facts.pop('device_work_inside_host_call', None)
  params, times = program.params, []
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
    if args.devices > 1:  # the mesh's devices, before JAX starts its CPU backend
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                                 f' --xla_force_host_platform_device_count={args.devices}')
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax import dataflow
  try:
    target = dataflow.GpuTarget.parse(args.target)
  except ValueError as e:
    print(f'compile_gpu: error: {e}', file=sys.stderr)
    return 2
  if args.run:
    return _main_run(args)
  available, why = dataflow.gpu_compiler_available()
  if not available:
    print(f'compile_gpu: error: {why}', file=sys.stderr)
    return 2
  options = {} if args.default_schedule else dict(dos_jax.GPU_COMPILER_OPTIONS)
  if args.devices > 1 or args.extrapolate:
    return _main_sharded(args, target, options)
  return _main_compile(args, target, options)


def _write_json(path, report) -> None:
  if path:
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=1)


def _main_run(args) -> int:
  """`--run N`: the runner's step run here, timed."""
  import jax
  if args.run < 1:
    print('compile_gpu: error: --run needs a positive number of steps', file=sys.stderr)
    return 2
  cfg = _config(args)
  report = {'policy': cfg.offload.policy, 'dtype': cfg.model.param_dtype,
            'early': args.early, 'jax': jax.__version__, **_run_here(args, cfg)}
  _write_json(args.json, report)
  print(f'SUMMARY {report["policy"]} {report["dtype"]} step on {report["device"]} '
        f'({report["backend"]}): median {report["median_step_s"] * 1e3:.2f} ms over '
        f'{args.run} steps, {report["tokens_per_s"]:.0f} tokens/s, compiled in '
        f'{report["compile_s"]:.1f} s'
        + (f'; gradient copies overlapping compute '
           f'{report["gradient_copies_overlapping_compute"]}/{report["gradient_copies"]},'
           f' device update inside host call {report["device_update_inside_host_call"]}'
           if 'gradient_copies' in report else ''))
  return 0


def _main_sharded(args, target, options) -> int:
  """`--devices N` / `--extrapolate`: the step over a mesh, its memory against the planner's."""
  import jax
  try:
    report = {'target': target.value, 'config': args.config, 'jax': jax.__version__,
              'compiler_options': options, **_sharded(args, target, options)}
  except ValueError as e:
    print(f'compile_gpu: error: {e}', file=sys.stderr)
    return 2
  _write_json(args.json, report)
  print(f'SUMMARY step over {args.devices} {target.value}: device peak'
        f' {report["device_peak_bytes"] / 1e9:.1f} GB per GPU ({report["device_peak_how"]});'
        f' planner {report["predicted_device_bytes"] / 1e9:.1f} GB'
        f' ({report["predicted_over_compiled"]:.3f}x)')
  return 0


def _main_compile(args, target, options) -> int:
  """The one-device step (or update program) compiled for `target`, and its schedule."""
  import jax
  cfg = _config(args)
  start = time.perf_counter()
  if args.program == 'step':
    program = _compile_step(args, cfg, target, options)
  else:
    program = _update_program(cfg, target, options)
  wall_s = time.perf_counter() - start
  summary = program.schedule.summary()
  report = {
      'target': target.value, 'program': args.program, 'policy': cfg.offload.policy,
      'dtype': cfg.model.param_dtype, 'early': args.early,
      'clip': cfg.optim.clip_norm is not None,
      'subgroup_size': cfg.offload.subgroup_size, 'compiler_options': options,
      'model': cfg.model.preset, 'jax': jax.__version__,
      'native_host_kernel': program.native_host_kernel,
      'compile_s': round(program.compile_s, 3), 'build_and_compile_s': round(wall_s, 3),
      'memory': dataclasses.asdict(program.memory),
      **{k: v for k, v in summary.items() if k != 'device_work_inside_host_call'},
  }
  _write_json(args.json, report)
  if args.hlo:
    with open(args.hlo, 'w', encoding='utf-8') as f:
      f.write(program.hlo_text)
  _print_schedule(args, cfg, target, program, summary)
  return 0


def _print_schedule(args, cfg, target, program, summary) -> None:
  import jax
  mib = lambda b: f'{b / 2**20:.1f} MiB'
  m = program.memory
  print(f'SUMMARY {args.program} {cfg.offload.policy} {cfg.model.param_dtype} on {target.value} '
        f'(jax {jax.__version__}, {"default" if args.default_schedule else "dos_jax"} '
        f'schedule): compiled in {program.compile_s:.1f} s')
  print(f'  gradient copies overlapping compute: '
        f'{summary["gradient_copies_overlapping_compute"]} of {summary["gradient_copies"]}')
  print(f'  host calls: {summary["host_calls"]}, '
        f'{summary["host_calls_starting_before_last_gemm"]} starting during the backward pass')
  print(f'  device update inside a host call: {summary["device_update_inside_host_call"]} '
        f'({summary["device_updates_outside_host_calls"]} device updates outside)')
  print(f'  streamed rows: {summary["streamed_row_fetches"]}, fetches after a write-back: '
        f'{summary["streamed_fetches_after_previous_write_back"]}')
  print(f'  large host->host copies: {summary["large_host_to_host_copies"]} '
        f'({mib(summary["large_host_to_host_copy_bytes"])})')
  print(f'  device: arguments {mib(m.argument_bytes)}, temp {mib(m.temp_bytes)}, outputs '
        f'{mib(m.output_bytes)}; host: arguments {mib(m.host_argument_bytes)}, temp '
        f'{mib(m.host_temp_bytes)}')


if __name__ == '__main__':
  sys.exit(main())
