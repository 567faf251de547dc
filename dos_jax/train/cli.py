"""`dos-jax train`, `dos-jax prepare` and `dos-jax export-hf`.

User mistakes (a bad key or value, a missing file, a mesh that does not fit the
machine) end with exit code 2 and one line on stderr naming the culprit; they are
caught here, at the edge, and nowhere deeper. Nothing is written before the config
and the inputs have been checked.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import textwrap
import traceback

from dos_jax.train.configlib import ConfigError

FAILED = 1
USAGE_ERROR = 2
INTERRUPTED = 130


def _fail(message: str) -> int:
  print(f'dos-jax: error: {message}', file=sys.stderr)
  return USAGE_ERROR


def _config_keys_epilog() -> str:
  from dos_jax.train import config  # pylint: disable=import-outside-toplevel
  from dos_jax.train.configlib import describe_fields  # pylint: disable=import-outside-toplevel

  from dos_jax import model_shapes  # pylint: disable=import-outside-toplevel
  from dos_jax.train import model_config  # pylint: disable=import-outside-toplevel

  # Keys typed as a plain str whose values ModelConfig checks.
  dtypes = ('float32', 'bfloat16')
  choices = {'model.preset': tuple(model_shapes.PRESETS), 'model.param_dtype': dtypes,
             'model.compute_dtype': dtypes, 'model.attention': model_config.ATTENTION}
  rows = describe_fields(config.RunConfig, choices)
  width = max(len(k) for k, _ in rows)
  lines = [f'  {k:<{width}}  {v}' for k, v in rows]
  return (
      'config keys, each with its default and what it accepts (dataclass defaults; the'
      ' packaged tiny config overrides some;\nsee the section docstrings in'
      ' dos_jax/train/config.py):\n' + '\n'.join(lines)
  )


def train_handler(args: argparse.Namespace) -> int:
  """Loads the config, trains; returns 0 when done, 1 when a step was not finite or the
  machine ran out of memory, 128 + the signal number when stopped by SIGINT (130) or
  SIGTERM (143) after saving a checkpoint."""
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax.planner import memory  # pylint: disable=import-outside-toplevel
  from dos_jax.train import compile_cache, config, distributed, loop  # pylint: disable=import-outside-toplevel

  overrides = args.set or ()
  for text in overrides:
    if '=' not in text and args.config is not None and not os.path.exists(args.config):
      # `--set train.steps 10`: argparse took `10` for CONFIG.
      return _fail(f'--set {text} {args.config}: expected KEY=VALUE with no spaces,'
                   f' e.g. --set {text}={args.config}')
  try:
    cfg = config.load(args.config, overrides)
    compile_cache.enable(cfg.train.compilation_cache)  # before the run's first compile
    if cfg.offload.keep_freed_host_memory:
      # Before JAX starts its worker threads, which would otherwise get arenas of
      # their own (see dos_jax.keep_freed_host_memory).
      dos_jax.keep_freed_host_memory()
    # XLA's GPU client reads its pinned-host cap once, when it starts: set it first.
    found = distributed.settings()
    pinned = memory.run_pinned_bytes(cfg, processes=found[1] if found else 1,
                                     local_devices=_visible_gpus())
    dos_jax.size_pinned_pool(pinned)
    # A multi-process run joins its peers before any JAX backend starts.
    distributed.initialize_from_env()
  except (ConfigError, dos_jax.PinnedPoolError) as err:
    return _fail(str(err))
  # Before any array or run folder exists: a run that cannot fit stops here.
  linked = 0.0
  if cfg.offload.disk_dir is not None:
    from dos_jax.train import checkpoint  # pylint: disable=import-outside-toplevel
    linked = checkpoint.linked_back_bytes(cfg.checkpoint_dir, cfg.offload.disk_dir)
  shortfall = memory.check_run(cfg, linked_back_bytes=linked)
  if shortfall is None:
    shortfall = _pinned_shortfall(pinned)
  if shortfall is not None:
    return _fail(shortfall)
  from dos_jax.train import faults  # pylint: disable=import-outside-toplevel

  # A fault of the machine (a full disk, a read-only folder, out of memory) is one line
  # naming its cause; its traceback and orbax's go to the run folder's error.log, or to
  # the terminal with --debug.
  with faults.RunLog(debug=args.debug) as log:
    try:
      summary = loop.train(cfg)
    except ConfigError as err:
      return _fail(config.blame(str(err), args.config, overrides))
    except KeyboardInterrupt:  # A second Ctrl-C, or one before the first step.
      print('dos-jax: interrupted', file=sys.stderr)
      return INTERRUPTED
    except Exception as err:  # pylint: disable=broad-exception-caught
      line = faults.describe(err, cfg)
      if line is None:
        raise
      if args.debug:
        traceback.print_exception(err)
        details = ''
      else:
        details = f' (details in {log.write(err, cfg.train.out_dir)})'
      print(f'dos-jax: error: {line}{details}', file=sys.stderr)
      return FAILED
  if summary.nonfinite_step is not None:
    return FAILED
  return 128 + summary.signal if summary.interrupted and summary.signal else (
      INTERRUPTED if summary.interrupted else 0)


def _visible_gpus() -> int | None:
  """NVIDIA GPUs this process may use, counted without starting a JAX backend:
  CUDA_VISIBLE_DEVICES's entries, else the /dev/nvidiaN device files; None for none."""
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  if visible is not None:
    return len([d for d in visible.split(',') if d.strip()]) or None
  try:
    return sum(name[6:].isdigit() for name in os.listdir('/dev')
               if name.startswith('nvidia')) or None
  except OSError:
    return None


def _pinned_shortfall(pinned_bytes: float) -> str | None:
  """On a GPU backend (now started), a pinned-host cap the user set below the plan's
  need, as one line; None elsewhere (on CPU the variable means nothing)."""
  import jax  # pylint: disable=import-outside-toplevel
  import dos_jax  # pylint: disable=import-outside-toplevel

  if jax.default_backend() != 'gpu':
    return None
  try:
    dos_jax.check_pinned_pool(pinned_bytes, what='the planned optimizer state')
  except dos_jax.PinnedPoolError as err:
    return str(err)
  return None


def prepare_handler(args: argparse.Namespace) -> int:
  """Tokenizes text files (default: the Python standard library) into a dataset."""
  from dos_jax.train import data  # pylint: disable=import-outside-toplevel

  for path in list(args.inputs) + ([args.tokenizer] if args.tokenizer else []):
    if not os.path.exists(path):
      return _fail(f'{path}: no such file or directory')
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    return _fail(f'--out {args.out}: exists and is not a directory')
  options = {}  # Only what the user gave: the defaults live in data.prepare.
  if args.val_fraction is not None:
    options['val_fraction'] = args.val_fraction
  if args.max_bytes is not None:
    options['max_bytes'] = args.max_bytes
  if args.min_val_tokens is not None:
    options['min_val_tokens'] = args.min_val_tokens
  try:
    meta = data.prepare(
        list(args.inputs) or None, args.out, tokenizer_path=args.tokenizer, progress=True,
        **options,
    )
  except ValueError as err:  # prepare names the input, tokenizer or option at fault.
    return _fail(str(err))
  print(
      f'wrote {args.out}: {meta.train_tokens:,} train and {meta.val_tokens:,} validation'
      f' tokens, vocabulary {meta.vocab_size}',
      file=sys.stderr,
  )
  return 0


def export_hf_handler(args: argparse.Namespace) -> int:
  """Writes a run's checkpoint as a Hugging Face Llama folder."""
  from dos_jax.train import hf_export  # pylint: disable=import-outside-toplevel

  try:
    hf_export.export(args.run_dir, args.out, args.step)
  except ConfigError as err:
    return _fail(str(err))
  return 0


def register(subparsers) -> None:
  """Adds `train`, `prepare` and `export-hf` to the `dos-jax` command."""
  train = subparsers.add_parser(
      'train',
      help='pretrain a Llama-style model with offloaded optimizer state',
      description=textwrap.fill(
          'Train (or resume) the run a YAML config describes. Without CONFIG, runs the'
          ' packaged tiny CPU config. A run directory holding checkpoints resumes from'
          ' the newest complete checkpoint (checksums verified). Ctrl-C or SIGTERM saves a'
          ' checkpoint and exits with code 130 or 143; a loss or gradient that is not finite'
          ' stops the run without saving that step and exits with code 1.', width=88,
      ),
      epilog=_config_keys_epilog(),
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  train.add_argument('config', nargs='?', metavar='CONFIG', help='YAML run config')
  train.add_argument(
      '--set', action='append', metavar='KEY=VALUE',
      help='override a config key, e.g. --set optim.lr=1e-3 (value read as YAML; repeatable)',
  )
  train.add_argument(
      '--debug', action='store_true',
      help='print tracebacks on the terminal instead of the run folder\'s error.log',
  )
  train.set_defaults(handler=train_handler)

  prepare = subparsers.add_parser(
      'prepare',
      help='tokenize text files into a token dataset for training',
      description=(
          'Tokenize text files (default: the Python standard library sources, present on'
          ' every machine) into a flat token file with a train/validation split.'
      ),
  )
  prepare.add_argument('inputs', nargs='*', metavar='INPUT', help='text files or directories')
  prepare.add_argument('--out', required=True, metavar='DIR', help='dataset directory to write')
  prepare.add_argument(
      '--tokenizer', metavar='tokenizer.json',
      help='a local Hugging Face tokenizer.json (default: built-in byte-level tokenizer)',
  )
  from dos_jax.train import data  # pylint: disable=import-outside-toplevel

  default_val = inspect.signature(data.prepare).parameters['val_fraction'].default
  prepare.add_argument(
      '--val-fraction', type=float, metavar='F',
      help=f'fraction of the tokens held out for validation, in [0, 1) (default: {default_val})',
  )
  prepare.add_argument(
      '--max-bytes', type=int, metavar='N',
      help=f'read at most this many bytes of text (default corpus: {data.DEFAULT_CORPUS_BYTES:,})',
  )
  prepare.add_argument(
      '--min-val-tokens', type=int, metavar='N',
      help=('least tokens in the validation split (raised to it with a warning), so that'
            f' evaluation windows of seq_len + 1 fit (default: {data.MIN_VAL_TOKENS})'),
  )
  prepare.set_defaults(handler=prepare_handler)

  export_hf = subparsers.add_parser(
      'export-hf',
      help="write a run's checkpoint as a Hugging Face Llama folder (safetensors)",
      description=textwrap.fill(
          "Write a run's newest complete checkpoint (or --step N) as config.json and"
          ' safetensors files (sharded above 5 GB, with model.safetensors.index.json) that'
          " transformers' LlamaForCausalLM.from_pretrained loads, with the tokenizer files"
          ' when the run was prepared with a tokenizer.json. DIR appears only once'
          ' complete.', width=88,
      ),
  )
  export_hf.add_argument('run_dir', metavar='RUN_DIR', help='the run directory (train.out_dir)')
  export_hf.add_argument('--out', required=True, metavar='DIR', help='folder to write (new)')
  export_hf.add_argument('--step', type=int, metavar='N', help='checkpoint step to export')
  export_hf.set_defaults(handler=export_hf_handler)
