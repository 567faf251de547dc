"""Hugging Face checkpoints in and out: time and peak host memory, and a continued
pretraining run whose first loss is checked against transformers (RESULTS.md, issue 31).

  python experiments/bench_hf.py make DIR [--shape llama3.2-1b] [--dtype bfloat16] [--kv-heads G]
  /usr/bin/time -v python experiments/bench_hf.py load DIR [--runner]
  /usr/bin/time -v python experiments/bench_hf.py save DIR OUT [--consume]
  python experiments/bench_hf.py cpt DIR RUN_DIR [--steps 100]

`make` writes a random LlamaForCausalLM of a preset's shape with transformers
(`save_pretrained`, its default 5 GB shards). `load` times `hf.load` (params in the
files' dtype) and prints the process's peak resident memory against the files' size;
`save` loads, then times `hf.save` alone. `cpt` trains the packaged tiny config from DIR
(`--set model.from_hf=DIR`, float32) and compares step 1's loss with transformers' loss
on the run's first batch. Each prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _file_bytes(folder: str) -> int:
  return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
             if n.endswith('.safetensors'))


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make(args) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from dos_jax import model_shapes  # pylint: disable=import-outside-toplevel

  s = model_shapes.PRESETS[args.shape]
  config = transformers.LlamaConfig(
      vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_dim,
      num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads,
      num_key_value_heads=args.kv_heads or s.kv_heads, tie_word_embeddings=s.tie_embeddings,
      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
      rope_scaling={'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0,
                    'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192})
  torch.manual_seed(args.seed)
  t0 = time.perf_counter()
  torch.set_default_dtype(getattr(torch, args.dtype))  # Drawn in it: no float32 copy.
  model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(args.dir)
  return {'made': args.dir, 'shape': args.shape, 'dtype': args.dtype, 'seed': args.seed,
          'params': sum(p.numel() for p in model.parameters()),
          'file_bytes': _file_bytes(args.dir), 'seconds': time.perf_counter() - t0}


def load(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from dos_jax.train import hf  # pylint: disable=import-outside-toplevel

  before = _peak_rss()
  t0 = time.perf_counter()
  if args.runner:  # The runner's path: each tensor placed on the (CPU) device as read.
    from dos_jax.train import config, mesh, trainer  # pylint: disable=import-outside-toplevel
    from dos_jax.train.model import ModelConfig  # pylint: disable=import-outside-toplevel
    dtype = json.load(open(os.path.join(args.dir, 'config.json'), encoding='utf-8'))
    dtype = dtype.get('torch_dtype', dtype.get('dtype'))
    cfg = config.RunConfig(model=ModelConfig(from_hf=args.dir, param_dtype=dtype))
    params, _ = trainer.hf_params(cfg, mesh.make_mesh(cfg.mesh, jax.devices()[:1]))
    jax.block_until_ready(params)
    cfg = cfg.model
  else:
    cfg, params = hf.load(args.dir)
  seconds = time.perf_counter() - t0
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  size = _file_bytes(args.dir)
  return {'path': 'trainer.hf_params' if args.runner else 'hf.load', 'load_s': seconds,
          'file_bytes': size, 'param_bytes': param_bytes,
          'param_dtype': cfg.param_dtype, 'rss_before_load': before,
          'peak_rss': _peak_rss(), 'peak_over_file': _peak_rss() / size,
          'added_over_file': (_peak_rss() - before) / size}


def save(args) -> dict:
  from dos_jax.train import hf  # pylint: disable=import-outside-toplevel

  cfg, params = hf.load(args.dir)
  after_load = _peak_rss()
  t0 = time.perf_counter()
  hf.save(cfg, params, args.out, consume=args.consume)
  seconds = time.perf_counter() - t0
  size = _file_bytes(args.out)
  return {'consume': args.consume, 'save_s': seconds, 'file_bytes': size, 'files': sorted(os.listdir(args.out)),
          'peak_rss_after_load': after_load, 'peak_rss': _peak_rss(),
          'peak_over_file': _peak_rss() / size}


def cpt(args) -> dict:
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from dos_jax.train import config, data, trainer  # pylint: disable=import-outside-toplevel
  from dos_jax.train.progress import read_metrics  # pylint: disable=import-outside-toplevel

  sets = [f'model.from_hf={args.dir}', 'model.param_dtype=float32',
          'model.compute_dtype=float32', f'train.steps={args.steps}',
          f'train.out_dir={args.run_dir}']
  cmd = [sys.executable, '-m', 'dos_jax.cli', 'train'] + [a for s in sets for a in ('--set', s)]
  t0 = time.perf_counter()
  subprocess.run(cmd, check=True)
  seconds = time.perf_counter() - t0
  records = read_metrics(os.path.join(args.run_dir, 'metrics.jsonl'))
  losses = {r['step']: r['loss'] for r in records if 'loss' in r}
  evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
  cfg = config.load(None, sets)
  batch = next(data.sampler_for(cfg.data, trainer.dataset_dir_for(cfg.data), 'train'))
  batch = torch.tensor(np.asarray(batch, np.int64))
  ref = transformers.LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = ref(batch[:, :-1]).logits.float()
  want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1)).item()
  return {'reference_loss_step1': want, 'run_loss_step1': losses[1],
          'abs_diff': abs(losses[1] - want), 'last_step': max(losses),
          'last_loss': losses[max(losses)], 'eval_losses': evals, 'seconds': seconds}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  sub = parser.add_subparsers(dest='what', required=True)
  p = sub.add_parser('make')
  p.add_argument('dir')
  p.add_argument('--shape', default='llama3.2-1b')
  p.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--kv-heads', type=int, help="key/value heads (default: the preset's)")
  p = sub.add_parser('load')
  p.add_argument('dir')
  p.add_argument('--runner', action='store_true',
                 help="the runner's model.from_hf path (placed on one device) instead")
  p = sub.add_parser('save')
  p.add_argument('dir')
  p.add_argument('out')
  p.add_argument('--consume', action='store_true',
                 help='free each param once converted (what export-hf does)')
  p = sub.add_parser('cpt')
  p.add_argument('dir')
  p.add_argument('run_dir')
  p.add_argument('--steps', type=int, default=100)
  args = parser.parse_args()
  print(json.dumps({'make': make, 'load': load, 'save': save, 'cpt': cpt}[args.what](args)))


if __name__ == '__main__':
  main()
