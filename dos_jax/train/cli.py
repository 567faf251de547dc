"""`dos-jax train` and `dos-jax prepare`.

User mistakes (a bad key or value, a missing file, a mesh that does not fit the
machine) end with exit code 2 and one line on stderr naming the culprit; they are
caught here, at the edge, and nowhere deeper. Nothing is written before the config
and the inputs have been checked.
"""

from __future__ import annotations

import argparse
import os
import sys

from dos_jax.train.configlib import ConfigError

USAGE_ERROR = 2
INTERRUPTED = 130


def _fail(message: str) -> int:
  print(f'dos-jax: error: {message}', file=sys.stderr)
  return USAGE_ERROR


def _config_keys_epilog() -> str:
  from dos_jax.train import config  # pylint: disable=import-outside-toplevel
  from dos_jax.train.configlib import describe_fields  # pylint: disable=import-outside-toplevel

  rows = describe_fields(config.RunConfig)
  width = max(len(k) for k, _ in rows)
  lines = [f'  {k:<{width}}  {v}' for k, v in rows]
  return (
      'config keys (dataclass defaults; the packaged tiny config overrides some;'
      ' see the section docstrings in dos_jax/train/config.py):\n' + '\n'.join(lines)
  )


def train_handler(args: argparse.Namespace) -> int:
  """Loads the config, trains; returns 0 when done, 130 when stopped by Ctrl-C."""
  from dos_jax.train import config, loop  # pylint: disable=import-outside-toplevel

  try:
    cfg = config.load(args.config, args.set or ())
  except ConfigError as err:
    return _fail(str(err))
  try:
    summary = loop.train(cfg)
  except ConfigError as err:
    return _fail(f'{args.config or "<packaged tiny.yaml>"}: {err}')
  except KeyboardInterrupt:  # A second Ctrl-C, or one before the first step.
    print('dos-jax: interrupted', file=sys.stderr)
    return INTERRUPTED
  return INTERRUPTED if summary.interrupted else 0


def prepare_handler(args: argparse.Namespace) -> int:
  """Tokenizes text files into a token dataset directory."""
  from dos_jax.train import data  # pylint: disable=import-outside-toplevel

  for path in list(args.inputs) + ([args.tokenizer] if args.tokenizer else []):
    if not os.path.exists(path):
      return _fail(f'{path}: no such file or directory')
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    return _fail(f'--out {args.out}: exists and is not a directory')
  if not 0.0 < args.val_fraction < 1.0:
    return _fail(f'--val-fraction: expected a number in (0, 1), got {args.val_fraction}')
  try:
    meta = data.prepare(
        list(args.inputs),
        args.out,
        tokenizer_path=args.tokenizer,
        val_fraction=args.val_fraction,
        max_bytes=args.max_bytes,
        progress=lambda message: print(message, file=sys.stderr),
    )
  except ConfigError as err:
    return _fail(str(err))
  print(f'wrote {args.out}: {meta}', file=sys.stderr)
  return 0


def register(subparsers) -> None:
  """Adds `train` and `prepare` to the `dos-jax` command."""
  train = subparsers.add_parser(
      'train',
      help='pretrain a GPT-style model with offloaded optimizer state',
      description=(
          'Train (or resume) the run a YAML config describes. Without CONFIG, runs the'
          ' packaged tiny CPU config. A run directory holding checkpoints resumes from'
          ' the newest. Ctrl-C saves a checkpoint and exits with code 130.'
      ),
      epilog=_config_keys_epilog(),
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  train.add_argument('config', nargs='?', metavar='CONFIG', help='YAML run config')
  train.add_argument(
      '--set', action='append', metavar='KEY=VALUE',
      help='override a config key, e.g. --set optim.lr=1e-3 (value read as YAML; repeatable)',
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
  prepare.add_argument(
      '--val-fraction', type=float, default=0.01,
      help='fraction of the tokens held out for validation (default: %(default)s)',
  )
  prepare.add_argument(
      '--max-bytes', type=int, default=None, help='read at most this many bytes of text',
  )
  prepare.set_defaults(handler=prepare_handler)
