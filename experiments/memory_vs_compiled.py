"""The planner's per-step memory and overlap assumptions against the compiled H100 program.

For each small config of the runner's presets, compiles the runner's real one-program
step for an H100 with no GPU (`tests.tooling.gpu_program.compile_step`), and compares:

* device bytes: `dos_jax.planner.step_memory.predict_step` against the compiled program's
  `MemoryStats.device_peak_bytes` (arguments + temp + outputs - aliased outputs);
* host temp: the prediction against `host_temp_bytes`;
* overlap: the cost model's assumptions (gradient copies hide behind the backward pass,
  all but the last piece; the device update runs while the host call runs) against the
  compiled schedule's facts.

Compiled figures are cached in `--cache` (JSON, one entry per config), so the comparison
can be redone without compiling again.

`--fsdp` compares ZeRO-3 instead: the `FSDP_CONFIGS` family compiled over 2 or 4 GPUs
(`gpu_program.compile_step` over the mesh, cuDNN attention, bf16, Stride(2)) against
`predict_step(cfg, devices=N)`, device bytes only.

`--early` compares the early host calls: an update-bound tiny step (4 layers, 32
tokens, bf16, Stride(2), clipping) with 1, 2 and 3 host calls of near-equal size
(`dos_jax.migrate(..., early=...)`), against `predict_step(cfg)`, device bytes and
host calls. (Linked chunks, the `--chunks` of before, are gone with `offload.chunks`.)

  JAX_PLATFORMS=cpu python3.12 experiments/memory_vs_compiled.py --cache /tmp/mem.json
  JAX_PLATFORMS=cpu python3.12 experiments/memory_vs_compiled.py --fsdp --cache /tmp/fsdp.json
  JAX_PLATFORMS=cpu python3.12 experiments/memory_vs_compiled.py --early --cache /tmp/early.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# (name, overrides): the runner's presets at small scale.
CONFIGS = (
    ('tiny L4 s128 b32', 'tiny', ('model.n_layers=4', 'data.seq_len=128', 'data.batch_size=32')),
    ('125m L2 s128 b4', '125m', ('model.n_layers=2', 'data.seq_len=128', 'data.batch_size=4')),
    ('tiny L2 s128 b32', 'tiny', ('model.n_layers=2', 'data.seq_len=128', 'data.batch_size=32')),
    ('tiny L4 s64 b32', 'tiny', ('model.n_layers=4', 'data.seq_len=64', 'data.batch_size=32')),
    ('tiny L4 s128 b8', 'tiny', ('model.n_layers=4', 'data.seq_len=128', 'data.batch_size=8')),
    ('125m L2 s256 b2', '125m', ('model.n_layers=2', 'data.seq_len=256', 'data.batch_size=2')),
    ('tiny L4 s128 b32 remat', 'tiny', ('model.n_layers=4', 'data.seq_len=128',
                                        'data.batch_size=32', 'model.remat=true')),
    ('125m L4 s256 b4', '125m', ('model.n_layers=4', 'data.seq_len=256', 'data.batch_size=4')),
)
# (name, fsdp, overrides): ZeRO-3 at small scale (RESULTS.md 2026-11-25, "the planner
# under fsdp"); the first three are tested (tests/test_compiled_fsdp.py).
FSDP_BASE = ('mesh.data=1', 'model.param_dtype=bfloat16', 'model.attention=cudnn',
             'offload.subgroup_size=65536', 'optim.clip_norm=1.0')
FSDP_CONFIGS = (
    ('tiny L4 s128 B32', 4, ()),
    ('tiny L4 s128 B32', 2, ()),
    ('tiny L4 s64 B32', 4, ('data.seq_len=64',)),
    ('tiny L2 s256 B16', 4, ('model.n_layers=2', 'data.seq_len=256', 'data.batch_size=16')),
    ('tiny L3 s128 B8', 2, ('model.n_layers=3', 'data.batch_size=8')),
    ('tiny L2 s128 B4', 4, ('model.n_layers=2', 'data.batch_size=4')),
    # Packed shard-major, as the two-memory program always is where the state is split.
    ('125m L2 s128 B8', 4, ('model.preset=125m', 'model.n_layers=2', 'data.batch_size=8',
                            'offload.subgroup_size=4194304')),
)
POLICIES = ('all_host', 'stride', 'device_fraction')
DTYPES = ('bfloat16', 'float32')
SUBGROUP = {'tiny': 65536, '125m': 4 * 2**20}


def overrides(preset: str, extra, policy: str, dtype: str) -> list[str]:
  return [f'model.preset={preset}', f'offload.policy={policy}',
          f'model.param_dtype={dtype}', f'offload.subgroup_size={SUBGROUP[preset]}',
          'optim.clip_norm=1.0', *extra]


def runs(full: bool):
  """(name, preset, extra, policy, dtype) of each comparison: every policy and dtype on
  the first config of each preset, stride bf16 on the others (all with `full`)."""
  for name, preset, extra in CONFIGS:
    first = name in ('tiny L4 s128 b32', '125m L2 s128 b4')
    for policy in POLICIES:
      for dtype in DTYPES:
        if full or (first and (dtype == 'bfloat16' or policy != 'device_fraction')) or (
            policy == 'stride' and dtype == 'bfloat16'):
          yield name, preset, extra, policy, dtype


def compile_one(preset, extra, policy, dtype) -> dict:
  from dos_jax.train import config as config_lib
  from tests.tooling import gpu_program
  cfg = config_lib.load(None, overrides(preset, extra, policy, dtype))
  start = time.perf_counter()
  program = gpu_program.compile_step(cfg, 'h100_sxm')
  schedule = program.schedule
  grads = schedule.gradient_copies()
  return {
      'memory': dataclasses.asdict(program.memory),
      'device_peak_bytes': program.memory.device_peak_bytes,
      'compile_s': round(time.perf_counter() - start, 1),
      'gradient_copies': len(grads),
      'overlapping': sum(c.overlaps_compute for c in grads),
      'overlapping_gemms': sum(c.gemms_between > 0 for c in grads),
      'not_overlapping_bytes': [c.nbytes for c in grads if not c.overlaps_compute],
      'gradient_copy_bytes': sum(c.nbytes for c in grads),
      'device_update_inside_host_call': schedule.device_update_inside_host_call(),
      'host_calls': len(schedule.host_calls),
      'large_host_copies': len(schedule.large_host_copies()),
  }


def fsdp_cfg(fsdp: int, extra):
  from dos_jax.train import config as config_lib
  return config_lib.load(None, [*FSDP_BASE, f'mesh.fsdp={fsdp}', *extra])


def compile_fsdp(fsdp: int, extra) -> dict:
  import jax
  from tests.tooling import gpu_program
  start = time.perf_counter()
  program = gpu_program.compile_step(fsdp_cfg(fsdp, extra), 'h100_sxm',
                                    devices=jax.devices()[:fsdp])
  return {'memory': dataclasses.asdict(program.memory),
          'device_peak_bytes': program.memory.device_peak_bytes,
          'compile_s': round(time.perf_counter() - start, 1)}


def main_fsdp(cache: dict, args) -> int:
  from dos_jax.planner import step_memory
  mib = lambda b: b / 2**20
  print('| config | fsdp | compiled device MiB | predicted device MiB | ratio |')
  print('|---|---|---|---|---|')
  for name, fsdp, extra in FSDP_CONFIGS:
    key = f'fsdp{fsdp} {name}'
    if key not in cache and not args.no_compile:
      cache[key] = compile_fsdp(fsdp, extra)
      with open(args.cache, 'w', encoding='utf-8') as f:
        json.dump(cache, f, indent=1)
    if key not in cache:
      continue
    got = cache[key]['device_peak_bytes']
    pred = step_memory.predict_step(fsdp_cfg(fsdp, extra), devices=fsdp).device_bytes
    print(f'| {name} | {fsdp} | {mib(got):.2f} | {mib(pred):.2f} | {pred / got:.3f} |',
          flush=True)
  return 0


EARLY_BASE = ('offload.policy=stride', 'model.param_dtype=bfloat16', 'model.n_layers=4',
              'optim.clip_norm=1.0', 'data.seq_len=32', 'data.batch_size=2')


def compile_with_calls(cfg, calls: int):
  """The runner's step compiled as `gpu_program.compile_step` does, with `calls` host
  calls of near-equal size moved in (`dos_jax.migrate(..., early=...)`)."""
  import dos_jax
  from dos_jax import dataflow
  from dos_jax.geometry import partition as partition_lib
  from tests.tooling import gpu_program
  from dos_jax.train import step as step_lib
  native = dataflow.compile.prepare()
  program = gpu_program.build_step(cfg)
  part = program.offloaded_state.partition
  early = tuple(len(p) for p in partition_lib.host_calls(part.host, calls)[:-1])
  opt_state = dos_jax.migrate(program.opt_state, part.plan, early=early)
  options = step_lib.compiler_options_for('gpu')
  with dos_jax.compiled_with(options):  # the step traced told their limit
    lowered = dataflow.lower_for_gpu(program.step, program.params, opt_state, program.tokens,
                                     kwargs={'plan': None})
  return dataflow.compile_lowered(lowered, 'h100_sxm', options, native_host_kernel=native)


def main_early(cache: dict, args) -> int:
  from dos_jax.planner import step_memory
  from dos_jax.train import config as config_lib
  mib = lambda b: b / 2**20
  print('| subgroup size | host calls | compiled device MiB | predicted device MiB |'
        ' ratio |')
  print('|---|---|---|---|---|')
  for size in (16384, 65536):
    for calls in (1, 2, 3):
      key = f'early {size} {calls}'
      cfg = config_lib.load(None, [*EARLY_BASE, f'offload.subgroup_size={size}'])
      if key not in cache and not args.no_compile:
        program = compile_with_calls(cfg, calls)
        cache[key] = {'device_peak_bytes': program.memory.device_peak_bytes,
                      'host_calls': len(program.schedule.host_calls)}
        with open(args.cache, 'w', encoding='utf-8') as f:
          json.dump(cache, f, indent=1)
      if key not in cache:
        continue
      got = cache[key]['device_peak_bytes']
      pred = step_memory.predict_step(cfg).device_bytes
      print(f'| {size} | {cache[key]["host_calls"]} | {mib(got):.2f} |'
            f' {mib(pred):.2f} | {pred / got:.3f} |', flush=True)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--cache', default='/tmp/memory_vs_compiled.json')
  parser.add_argument('--full', action='store_true', help='every policy x dtype per config')
  parser.add_argument('--no-compile', action='store_true', help='use only cached figures')
  parser.add_argument('--fsdp', action='store_true', help='the ZeRO-3 family instead')
  parser.add_argument('--early', action='store_true',
                      help='1, 2 and 3 host calls of an update-bound step instead')
  args = parser.parse_args(argv)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  if args.fsdp:  # the mesh's devices, before JAX starts its CPU backend
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               ' --xla_force_host_platform_device_count=4')
  cache = {}
  if os.path.exists(args.cache):
    with open(args.cache, encoding='utf-8') as f:
      cache = json.load(f)
  if args.fsdp:
    return main_fsdp(cache, args)
  if args.early:
    return main_early(cache, args)
  if not args.no_compile:
    for name, preset, extra, policy, dtype in runs(args.full):
      key = f'{name} {policy} {dtype}'
      if key not in cache:
        cache[key] = compile_one(preset, extra, policy, dtype)
        print(f'compiled {key}: {cache[key]["device_peak_bytes"] / 2**20:.1f} MiB',
              file=sys.stderr, flush=True)
        with open(args.cache, 'w', encoding='utf-8') as f:
          json.dump(cache, f, indent=1)
  from dos_jax.planner import step_memory
  from dos_jax.train import config as config_lib
  mib = lambda b: b / 2**20
  print('| config | policy | params | predicted device MiB | compiled device MiB | ratio |'
        ' predicted host temp MiB | compiled host temp MiB | grad copies hidden |'
        ' device update in host call |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  worst = 0.0
  for name, preset, extra, policy, dtype in runs(args.full):
    key = f'{name} {policy} {dtype}'
    if key not in cache:
      continue
    got = cache[key]
    cfg = config_lib.load(None, overrides(preset, extra, policy, dtype))
    pred = step_memory.predict_step(cfg)
    ratio = pred.device_bytes / got['device_peak_bytes']
    worst = max(worst, abs(ratio - 1))
    short = 'bf16' if dtype == 'bfloat16' else 'fp32'
    print(f'| {name} | {policy} | {short} | {mib(pred.device_bytes):.1f} |'
          f' {mib(got["device_peak_bytes"]):.1f} | {ratio:.3f} |'
          f' {mib(pred.host_temp_bytes):.1f} | {mib(got["memory"]["host_temp_bytes"]):.1f} |'
          f' {got["overlapping"]} of {got["gradient_copies"]} |'
          f' {got["device_update_inside_host_call"] if policy != "all_host" else "-"} |',
          flush=True)
  print(f'\nworst device-bytes error: {worst:.1%}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
