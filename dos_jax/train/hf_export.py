"""`dos-jax export-hf RUN_DIR --out DIR [--step N]`: a run's checkpoint as a Hugging
Face Llama folder.

Reads RUN_DIR/config.yaml (the resolved config the run wrote), restores only the params
of the newest complete checkpoint (or step N; checksums verified), onto the CPU, and
writes them with `dos_jax.train.hf.save`: config.json, safetensors (sharded above 5 GB,
with the index) and the tokenizer files when the run's dataset was prepared with a
tokenizer.json. The folder appears under DIR's name only once complete.

Every mistake (no such run, no checkpoint, DIR taken) is a `ConfigError` raised before
anything is written.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

import jax

from dos_jax.train import checkpoint as ckpt_lib
from dos_jax.train import data as data_lib
from dos_jax.train import hf
from dos_jax.train import integrity
from dos_jax.train import model as model_lib
from dos_jax.train.config import RunConfig
from dos_jax.train.configlib import ConfigError, from_dict, read_yaml

RUN_CONFIG = 'config.yaml'
# Files beside a tokenizer.json that transformers' AutoTokenizer also reads.
_TOKENIZER_SIDECARS = ('tokenizer_config.json', 'special_tokens_map.json')


def run_config(run_dir: str) -> RunConfig:
  """The run's resolved config, without reading `model.from_hf` again (its sizes and
  settings are already in the file; the folder may be gone)."""
  path = os.path.join(run_dir, RUN_CONFIG)
  try:
    with open(path, encoding='utf-8') as f:
      data = read_yaml(f.read(), path)
  except FileNotFoundError:
    raise ConfigError(f'{run_dir}: not a run directory (no {RUN_CONFIG})') from None
  except OSError as err:
    raise ConfigError(f'{path}: cannot read ({type(err).__name__})') from None
  model = data.get('model')
  if isinstance(model, dict):
    model.pop('from_hf', None)
  try:
    return from_dict(RunConfig, data)
  except ConfigError as err:
    raise ConfigError(f'{path}: {err}') from None


def checkpoint_dir(cfg: RunConfig, run_dir: str) -> str:
  """Where the run's checkpoints are: `checkpoint.dir`, else RUN_DIR/checkpoints."""
  return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, 'checkpoints'))


def tokenizer_files(cfg: RunConfig, stream: TextIO) -> tuple[str, ...]:
  """The tokenizer.json the run's dataset was prepared with and its sidecars, if that
  file is still there unchanged; () for the byte tokenizer."""
  from dos_jax.train import trainer  # pylint: disable=import-outside-toplevel

  try:
    meta = data_lib.load_meta(trainer.dataset_dir_for(cfg.data))
  except (ConfigError, ValueError, OSError) as err:
    print(f'export-hf: the run\'s dataset cannot be read ({err}); no tokenizer copied',
          file=stream)
    return ()
  if meta.tokenizer_sha256 is None:
    return ()
  path = meta.tokenizer
  if not os.path.isfile(path) or integrity.file_sha256(path) != meta.tokenizer_sha256:
    print(f'export-hf: {path}, the run\'s tokenizer, is gone or changed; not copied',
          file=stream)
    return ()
  folder = os.path.dirname(path)
  sidecars = [os.path.join(folder, n) for n in _TOKENIZER_SIDECARS]
  return (path, *[p for p in sidecars if os.path.isfile(p)])


def export(run_dir: str, out: str, step: int | None = None, *,
           stream: TextIO | None = None) -> str:
  """Writes checkpoint `step` (default: the newest complete one) of the run in
  `run_dir` as a Hugging Face LlamaForCausalLM folder `out`; returns its path.

  Raises:
    ConfigError: one line naming the culprit; nothing is written then.
  """
  stream = stream if stream is not None else sys.stderr
  # Relative paths are the caller's working directory's (orbax takes absolute ones only).
  run_dir = os.path.abspath(run_dir)
  cfg = run_config(run_dir)
  if cfg.mesh.pipeline > 1:
    raise ConfigError(f'{run_dir}: a pipelined run (mesh.pipeline > 1) cannot be exported yet')
  out = os.path.abspath(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ConfigError(f'--out {out}: exists; give a new folder')
  directory = checkpoint_dir(cfg, run_dir)
  if step is None:
    step, _, _ = ckpt_lib.find_restorable(directory)
    if step is None:
      raise ConfigError(f'{run_dir}: no complete checkpoint in {directory}')
  else:
    step_dir = os.path.join(directory, str(step))
    if not os.path.isdir(step_dir):
      raise ConfigError(f'--step {step}: no checkpoint {step_dir}')
    try:
      integrity.verify(step_dir)
    except integrity.CheckpointDamaged as err:
      raise ConfigError(f'--step {step}: {err}') from None
  extra = tokenizer_files(cfg, stream)
  params = restore_params(cfg.model, directory, step)
  hf.save(cfg.model, params, out, extra_files=extra, consume=True)
  print(f'wrote {out}: step {step} of {run_dir} as a LlamaForCausalLM'
        f'{" with its tokenizer" if extra else ""}', file=stream)
  return out


def restore_params(model_cfg: model_lib.ModelConfig, directory: str, step: int):
  """Only the params of checkpoint `step`, on the first CPU device."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  cpu = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu),
      jax.eval_shape(lambda: model_lib.init_params(model_cfg, 0)))
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_names=('params', 'opt_state', 'meta'))
  try:
    restored = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  finally:
    manager.close()
  return restored['params']
