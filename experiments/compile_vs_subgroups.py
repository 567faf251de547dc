"""Lowering and H100 compile time of the two-memory program against its subgroup count.

The two-memory program has one update per subgroup (one storage: per subgroup). This
times, for an L-layer MLP with one subgroup per layer (L = G), the train step with
`dos_jax.adamw` (Stride(2), nothing else set: the one construction) against the same
step with `optax.adamw` (the model's own compile, measured in the same run), each traced,
lowered for 'cuda' and compiled for an H100 target with `GPU_COMPILER_OPTIONS` (no GPU
needed; Python 3.12 with jax[cuda13]==0.11.2):

  JAX_PLATFORMS=cpu python3.12 experiments/compile_vs_subgroups.py --subgroups 100,300,700

Prints one JSON line per G: lower and compile seconds of both (every compile: a step
whose early host calls XLA did not name as predicted compiles twice,
`dataflow.early_windows`), their ratio, host calls, the compiles,
and the seconds of XLA's slowest passes in each (from its module metadata, dumped to a
temporary folder).
"""

from __future__ import annotations

import argparse
import collections
import dos_jax
import glob
import jax
import jax.numpy as jnp
import json
import numpy as np
import optax
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tooling

from dos_jax import dataflow
from dos_jax.dataflow import compile as compile_lib
from tests.tooling import probes


def _timed(step, args, target, early_windows):
  """(lowering seconds, the compiled program, {XLA pass: seconds over every compile})."""
  start = time.perf_counter()
  lowered = dataflow.lower_for_gpu(step, *args, target=dataflow.GpuTarget.parse(target))
  lower_s = time.perf_counter() - start
  with tempfile.TemporaryDirectory(prefix='dos_jax_passes_') as dump:
    options = dict(dos_jax.GPU_COMPILER_OPTIONS, xla_dump_to=dump,
                   xla_dump_module_metadata=True, xla_dump_hlo_pass_re='NONE')
    program = compile_lib.compile_lowered(lowered, target, compiler_options=options,
                                          early_windows=early_windows)
    passes = collections.Counter()
    for path in glob.glob(os.path.join(dump, '*.metadata.textproto')):
      with open(path, encoding='utf-8') as f:
        passes.update(_pass_seconds(f.read()))
  return lower_s, program, passes


def _pass_seconds(metadata: str) -> dict[str, float]:
  """{pass name: seconds} from one module's metadata (`HloModuleMetadataProto` text)."""
  seconds = collections.Counter()
  for block in metadata.split('pass_metadata {')[1:]:
    name = re.search(r'pass_name: "([^"]*)"', block).group(1)
    start, end = (int(re.search(rf'{k}_timestamp_usec: (\d+)', block).group(1))
                  for k in ('start', 'end'))
    seconds[name] += (end - start) / 1e6
  return seconds


def measure(layers: int, width: int, target: str) -> dict:
  params = jax.device_put(probes.mlp_params(layers, width, jnp.bfloat16), jax.devices()[0])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, width)), jnp.bfloat16)

  def make(opt):
    def step(p, s, x):
      loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, loss
    return step

  offload = dos_jax.Offload(subgroup_size=width * width + width)
  ours = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(
      1e-3, offload=offload, implementation=dos_jax.Implementation(program='gpu')))
  theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  native = compile_lib.prepare(target)
  del native
  lower_ours, prog_ours, passes_ours = _timed(make(ours), (params, ours.init(params), x),
                                              target, True)
  lower_base, prog_base, passes_base = _timed(make(theirs), (params, theirs.init(params), x),
                                              target, False)
  schedule = prog_ours.schedule
  return {
      'subgroups': layers, 'width': width, 'target': target,
      'dos_jax_lower_s': round(lower_ours, 1), 'dos_jax_compile_s': round(prog_ours.compile_s, 1),
      'optax_lower_s': round(lower_base, 1), 'optax_compile_s': round(prog_base.compile_s, 1),
      'ratio_lower_plus_compile': round((lower_ours + prog_ours.compile_s)
                                        / (lower_base + prog_base.compile_s), 1),
      'host_calls': len(schedule.host_calls),
      'compiles': prog_ours.compiles,
      'dos_jax_slowest_passes_s': _slowest(passes_ours),
      'optax_slowest_passes_s': _slowest(passes_base),
  }


def _slowest(passes, n: int = 3) -> dict[str, float]:
  return {name: round(s, 1) for name, s in passes.most_common(n)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--subgroups', default='100,300,700')
  parser.add_argument('--width', type=int, default=64)
  parser.add_argument('--target', default='h100_sxm')
  args = parser.parse_args()
  for g in (int(v) for v in args.subgroups.split(',')):
    print(json.dumps(measure(g, args.width, args.target)), flush=True)


if __name__ == '__main__':
  main()
