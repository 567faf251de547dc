"""Lowering and H100 compile time of the accelerator program against its subgroup count.

The accelerator program has one update per subgroup (one storage: per subgroup). This
times, for an L-layer MLP with one subgroup per layer (L = G), the train step with
`dos_jax.adamw` (Stride(2), nothing else set: the one construction) against the same
step with `optax.adamw` (the model's own compile, measured in the same run), each traced,
lowered for 'cuda' and compiled for an H100 target with `GPU_COMPILER_OPTIONS` (no GPU
needed; Python 3.12 with jax[cuda13]==0.11.2):

  JAX_PLATFORMS=cpu python3.12 experiments/compile_vs_subgroups.py --subgroups 100,300,700

Prints one JSON line per G: lower and compile seconds of both, their ratio, host calls.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax
from dos_jax import dataflow
from dos_jax.dataflow import compile as compile_lib
from dos_jax.dataflow import probes


def _timed(step, args, target, early_windows):
  start = time.perf_counter()
  lowered = dataflow.lower_for_gpu(step, *args, target=dataflow.GpuTarget.parse(target))
  lower_s = time.perf_counter() - start
  program = compile_lib.compile_lowered(lowered, target, early_windows=early_windows)
  return lower_s, program


def measure(layers: int, width: int, target: str) -> dict:
  params = jax.device_put(probes.mlp_params(layers, width, jnp.bfloat16), jax.devices()[0])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, width)), jnp.bfloat16)

  def make(opt):
    def step(p, s, x):
      loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, loss
    return step

  offload = dos_jax.Offload(subgroup_size=width * width + width, platform='gpu')
  ours = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(1e-3, offload=offload))
  theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  native = compile_lib.prepare(target)
  del native
  lower_ours, prog_ours = _timed(make(ours), (params, ours.init(params), x), target, True)
  lower_base, prog_base = _timed(make(theirs), (params, theirs.init(params), x), target, False)
  schedule = prog_ours.schedule
  return {
      'subgroups': layers, 'width': width, 'target': target,
      'dos_jax_lower_s': round(lower_ours, 1), 'dos_jax_compile_s': round(prog_ours.compile_s, 1),
      'optax_lower_s': round(lower_base, 1), 'optax_compile_s': round(prog_base.compile_s, 1),
      'ratio_lower_plus_compile': round((lower_ours + prog_ours.compile_s)
                                        / (lower_base + prog_base.compile_s), 1),
      'host_calls': len(schedule.host_calls),
  }


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
