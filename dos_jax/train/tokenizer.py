"""Tokenizers for `prepare`: raw bytes built in, a local `tokenizer.json` optionally.

The byte tokenizer needs nothing and is what the default corpus and the CPU presets use
(vocabulary 256). A Hugging Face `tokenizer.json` is read with the `tokenizers` package
when it is installed; nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

BYTES = 'bytes'


class Tokenizer(Protocol):
  """What `prepare` needs from a tokenizer."""

  # 'bytes', or the absolute path of the tokenizer.json; recorded in meta.json.
  name: str
  # sha256 of the tokenizer file, so a dataset can be matched to its tokenizer later.
  sha256: str | None
  vocab_size: int

  def encode(self, data: bytes) -> np.ndarray:
    """Token ids of one document given as raw bytes."""

  def decode(self, ids) -> str:
    """Text of a sequence of token ids."""


class ByteTokenizer:
  """Each byte is a token: lossless for any file, no vocabulary to ship."""

  name = BYTES
  sha256 = None
  vocab_size = 256

  def encode(self, data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode('utf-8', errors='replace')


class JsonTokenizer:
  """A local Hugging Face `tokenizer.json`, through the `tokenizers` package."""

  def __init__(self, path: Path):
    if not path.is_file():
      raise ValueError(f'tokenizer file {path} does not exist')
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise ValueError(
          f'tokenizer file {path} needs the `tokenizers` package: pip install tokenizers'
      ) from None
    raw = path.read_bytes()
    try:
      self._tok = tokenizers.Tokenizer.from_str(raw.decode('utf-8'))
    except Exception as e:  # The package raises bare Exceptions from Rust.
      first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ValueError(f'tokenizer file {path} is not a valid tokenizer.json: {first_line}') from None
    self.name = str(path.resolve())
    self.sha256 = hashlib.sha256(raw).hexdigest()
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, data: bytes) -> np.ndarray:
    text = data.decode('utf-8', errors='replace')
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

  def decode(self, ids) -> str:
    return self._tok.decode(np.asarray(ids).tolist())


def load_tokenizer(path: str | Path | None) -> Tokenizer:
  """The byte tokenizer for None, else the tokenizer.json at `path` (ValueError if unusable)."""
  if path is None:
    return ByteTokenizer()
  return JsonTokenizer(Path(path))
