"""Argument types and number formats of `dos-jax plan`: each type parses one flag's
text or raises `argparse.ArgumentTypeError`, which argparse prints as one line naming
the flag."""

from __future__ import annotations

import argparse
import math
import re

_UNITS = {
    '': 1, 'b': 1, 'kb': 1e3, 'mb': 1e6, 'gb': 1e9, 'tb': 1e12,
    'kib': 2**10, 'mib': 2**20, 'gib': 2**30, 'tib': 2**40,
}


def parse_bytes(text: str) -> float:
  """'80GB', '79GiB', '8e10' -> bytes."""
  match = re.fullmatch(r'\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?b|b)?\s*', text.lower())
  if not match:
    raise argparse.ArgumentTypeError(f'not a memory size: {text!r} (e.g. 80GB, 79GiB, 8e10)')
  value = float(match.group(1)) * _UNITS[match.group(2) or '']
  if value <= 0:
    raise argparse.ArgumentTypeError(f'memory size must be positive, got {text!r}')
  return value


def _number(text: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'not a number: {text!r}') from None


def positive_int(text: str) -> int:
  value = _number(text)
  if value < 1 or value != int(value):
    raise argparse.ArgumentTypeError(f'must be a positive integer, got {text!r}')
  return int(value)


def fraction(text: str) -> float:
  value = _number(text)
  if not 0.0 <= value <= 1.0:
    raise argparse.ArgumentTypeError(f'must be in [0, 1], got {text!r}')
  return value


def positive_float(text: str) -> float:
  value = _number(text)
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f'must be a positive number, got {text!r}')
  return value


def gib(n: float) -> str:
  return f'{n / 2**30:,.1f} GiB'


def ms(s: float) -> str:
  if s < 0.1:
    return f'{s * 1e3:.3g} ms'
  return f'{s * 1e3:,.0f} ms' if s < 10 else f'{s:,.1f} s'


def gbps_pair(text: str) -> tuple[float, float]:
  """'6,4' -> (6.0, 4.0): a disk's read and write bandwidth, GB/s."""
  parts = text.split(',')
  try:
    values = tuple(float(p) for p in parts)
  except ValueError:
    values = ()
  if len(values) != 2 or not all(math.isfinite(v) and v > 0 for v in values):
    raise argparse.ArgumentTypeError(
        f'expected READ,WRITE, two positive GB/s figures (e.g. 6,4), got {text!r}')
  return values
