"""The `dos-jax` command: subcommands `train`, `prepare` and `plan`.

Each subcommand lives next to the code it drives and registers itself through a
`register(subparsers)` function, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='dos-jax',
      description='Train transformers whose optimizer state lives in host memory.',
  )
  subparsers = parser.add_subparsers(dest='command', required=True)
  # Imported here so that `dos-jax --help` stays fast and each module stays optional.
  from dos_jax.train import cli as train_cli  # pylint: disable=import-outside-toplevel
  from dos_jax.planner import plan_cli  # pylint: disable=import-outside-toplevel

  train_cli.register(subparsers)
  plan_cli.register(subparsers, config_settings=_config_settings)
  return parser


def _config_settings(path: str):
  """A run config's `plan_cli.RunSettings`, for `dos-jax plan --config` (ValueError:
  one line)."""
  from dos_jax.planner import plan_cli  # pylint: disable=import-outside-toplevel
  from dos_jax.train import config as train_config  # pylint: disable=import-outside-toplevel
  try:
    cfg = train_config.load(path)
  except train_config.ConfigError as e:
    raise ValueError(str(e)) from None
  mesh = cfg.mesh
  devices = mesh.data * mesh.fsdp * mesh.tensor * mesh.pipeline if mesh.data > 0 else None
  data_shards = (mesh.data if mesh.data > 0 else 1) * mesh.fsdp
  return plan_cli.RunSettings(
      shape=cfg.model.shape(),
      param_dtype='bf16' if cfg.model.param_dtype == 'bfloat16' else 'fp32',
      seq_len=cfg.data.seq_len,
      micro_batch=max(cfg.data.batch_size // data_shards, 1),
      remat=cfg.model.remat,
      attention=cfg.model.attention,
      devices=devices,
  )


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  return int(args.handler(args) or 0)


def run() -> None:
  """The `dos-jax` command's process: exits with `main()`'s status. A run that failed
  (status 1: a fault of the machine, a non-finite loss) has by then closed its
  checkpointer and metrics and written its line and error.log; it leaves at once
  (`os._exit`), so that a library's thread still blocked on the failed write cannot
  keep the process alive after its error."""
  code = main()
  if code == 1:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)


if __name__ == '__main__':
  run()
