"""Writing a token dataset: its format on disk, and `prepare`, which writes one.

A dataset is a directory holding `train.bin` and `val.bin`, flat arrays of token ids
(uint16, or uint32 for vocabularies past 65536: the layout of nanoGPT's .bin files), and
`meta.json` describing them (`DatasetMeta`). `meta.json` is written last, so a directory
with one is complete; a crash mid-way leaves at most hidden temporary files.

With no inputs, `prepare` uses the default corpus: the Python standard library's own
`.py` sources, real text present on every machine that runs this code. Reading a
dataset (`load_meta`, `BatchSampler`) is `dos_jax.train.data`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dos_jax.train import tokenizer as tokenizer_lib

SPLITS = ('train', 'val')
DEFAULT_CORPUS_BYTES = 8 * 2**20
MIN_VAL_TOKENS = 1025
"""Default least size of a validation split: evaluation windows up to seq_len 1024."""
META = 'meta.json'
_PROGRESS_EVERY = 4 * 2**20
_READ_CHUNK = 2**20
_SKIP_DIRS = frozenset({'__pycache__', 'site-packages', 'dist-packages'})


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
  """Contents of meta.json."""

  # Tokens ids are < vocab_size.
  vocab_size: int
  # numpy dtype name of the .bin files: 'uint16' or 'uint32'.
  dtype: str
  train_tokens: int
  val_tokens: int
  # 'bytes', or the absolute path of the tokenizer.json used.
  tokenizer: str
  # sha256 of that tokenizer.json; None for bytes.
  tokenizer_sha256: str | None
  # The inputs as given (or 'python-stdlib:<dir>' for the default corpus).
  sources: tuple[str, ...]
  num_files: int
  # Files under input directories skipped as binary (a NUL byte in their first 8 KiB).
  skipped_files: int
  # Input bytes read (after the max_bytes cap).
  input_bytes: int
  val_fraction: float
  max_bytes: int | None

  def num_tokens(self, split: str) -> int:
    return self.train_tokens if split == 'train' else self.val_tokens

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2) + '\n'


def dtype_for(vocab_size: int) -> np.dtype:
  """The .bin files' dtype for a vocabulary: uint16 up to 65536 ids, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def stdlib_dir() -> Path:
  """The Python standard library's source directory (the default corpus)."""
  return Path(sysconfig.get_paths()['stdlib'])


def _walk(root: Path, suffix: str | None, exclude: Path) -> Iterator[Path]:
  """Regular files under root, depth-first with names sorted: the same order everywhere.
  `exclude` (the output directory) is skipped so a dataset never reads itself."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(
        d for d in dirnames
        if d not in _SKIP_DIRS and not d.startswith('.')
        and (Path(dirpath) / d).resolve() != exclude
    )
    for name in sorted(filenames):
      if name.startswith('.') or (suffix is not None and not name.endswith(suffix)):
        continue
      path = Path(dirpath) / name
      if path.is_file():
        yield path


def _looks_binary(path: Path) -> bool:
  with open(path, 'rb') as f:
    return b'\0' in f.read(8192)


class _Progress:
  """One line to stderr per _PROGRESS_EVERY input bytes, and a final one."""

  def __init__(self, enabled: bool):
    self.enabled, self.start, self.next_report = enabled, time.monotonic(), _PROGRESS_EVERY

  def update(self, num_bytes: int, num_files: int, num_tokens: int):
    if self.enabled and num_bytes >= self.next_report:
      self.next_report = (num_bytes // _PROGRESS_EVERY + 1) * _PROGRESS_EVERY
      print(f'prepare: {num_bytes / 2**20:.0f} MiB read, {num_files} files, '
            f'{num_tokens} tokens, {time.monotonic() - self.start:.1f} s', file=sys.stderr)

  def done(self, out_dir: Path, meta: DatasetMeta):
    if self.enabled:
      print(f'prepare: wrote {meta.train_tokens} train + {meta.val_tokens} val tokens from '
            f'{meta.num_files} files ({meta.skipped_files} binary skipped) to {out_dir} in '
            f'{time.monotonic() - self.start:.1f} s', file=sys.stderr)


def _pieces(
    inputs: list[Path], suffix: str | None, max_bytes: int | None, chunk: int | None,
    exclude: Path, counts: dict[str, int],
) -> Iterator[bytes]:
  """The bytes of the input files in order, in pieces of at most `chunk` bytes (None: one
  piece per file, for tokenizers that must see whole texts), stopping after max_bytes."""
  for root in inputs:
    files = [root] if root.is_file() else _walk(root, suffix, exclude)
    for path in files:
      if max_bytes is not None and counts['bytes'] >= max_bytes:
        return
      if path is not root and _looks_binary(path):
        counts['skipped'] += 1
        continue
      counts['files'] += 1
      with open(path, 'rb') as f:
        while True:
          want = -1 if chunk is None else chunk
          if max_bytes is not None:
            left = max_bytes - counts['bytes']
            if left <= 0:
              break
            want = left if want < 0 else min(want, left)
          data = f.read(want)
          if not data:
            break
          counts['bytes'] += len(data)
          yield data
          if chunk is None:
            break


def _val_size(num_tokens: int, val_fraction: float, minimum: int, *, warn: bool) -> int:
  """Tokens of the validation split: `val_fraction` of the stream, raised to `minimum`
  while at least as many tokens stay for training (then capped at half the stream)."""
  num_val = math.ceil(num_tokens * val_fraction)
  if val_fraction == 0 or num_val >= minimum:
    return num_val
  raised = min(minimum, num_tokens // 2)
  if warn:
    if raised < minimum:
      note = (f'the corpus ({num_tokens} tokens) is too small for that; the split is half'
              f' of it ({raised} tokens), enough for data.seq_len <= {raised - 1}')
    else:
      note = f'enough for data.seq_len <= {raised - 1}'
    print(f'prepare: warning: validation split raised from {num_val} to {raised} tokens'
          f' (minimum {minimum}, --min-val-tokens): {note}', file=sys.stderr)
  return max(num_val, raised)


def _copy(src: np.ndarray, f) -> None:
  for start in range(0, len(src), _READ_CHUNK):
    f.write(np.asarray(src[start:start + _READ_CHUNK]).tobytes())


def _umask_mode(mode: int = 0o666) -> int:
  """`mode` as the process umask lets a new file have it (as `dos_jax.cache`'s files)."""
  current = os.umask(0)
  os.umask(current)
  return mode & ~current


def prepare(
    inputs: list[Path] | None,
    out_dir: Path,
    *,
    tokenizer_path: str | Path | None = None,
    val_fraction: float = 0.01,
    max_bytes: int | None = None,
    min_val_tokens: int = MIN_VAL_TOKENS,
    progress: bool = True,
) -> DatasetMeta:
  """Tokenizes text files into `out_dir`/{train,val}.bin and meta.json.

  Files are concatenated in order (directories walked recursively, names sorted; hidden
  files, __pycache__ and files with NUL bytes skipped) with no separator, and the last
  `val_fraction` of the tokens becomes the validation split.

  Args:
    inputs: files and directories; None for the default corpus (the standard library's
      .py files, capped at DEFAULT_CORPUS_BYTES unless max_bytes says otherwise).
    out_dir: created if needed; a dataset already there is replaced only on success.
    tokenizer_path: a tokenizer.json; None for bytes (vocabulary 256).
    val_fraction: share of tokens, in [0, 1), held out for validation.
    max_bytes: stop reading input after this many bytes.
    min_val_tokens: the validation split holds at least this many tokens (when
      `val_fraction` > 0), so that evaluation windows of `seq_len + 1` fit; a split
      raised to it, or a corpus too small for it, is reported with a warning.
    progress: print progress lines to stderr.

  Returns:
    The metadata written to meta.json.
  """
  _check_arguments(val_fraction, max_bytes, min_val_tokens)
  tok = tokenizer_lib.load_tokenizer(tokenizer_path)
  roots, suffix, sources, max_bytes = _inputs(inputs, max_bytes)
  dtype = dtype_for(tok.vocab_size)
  out_dir = Path(out_dir)
  made = not out_dir.exists()  # Removed again if nothing gets written into it.
  out_dir.mkdir(parents=True, exist_ok=True)

  temps: list[Path] = []

  def temp_file(name):
    fd, path = tempfile.mkstemp(prefix=f'.{name}.', suffix='.tmp', dir=out_dir)
    temps.append(Path(path))
    os.fchmod(fd, _umask_mode())  # mkstemp makes 0600; a dataset is for sharing.
    return os.fdopen(fd, 'wb')

  counts = {'bytes': 0, 'files': 0, 'skipped': 0}
  report = _Progress(progress)
  try:
    with temp_file('train.bin') as f:
      num_tokens = _write_tokens(f, tok, dtype, _pieces(
          roots, suffix, max_bytes, _READ_CHUNK if tok.name == tokenizer_lib.BYTES else None,
          out_dir.resolve(), counts), counts, report)
    if num_tokens == 0:
      raise ValueError(f'no text found in {", ".join(sources)}')
    num_val = _val_size(num_tokens, val_fraction, min_val_tokens, warn=progress)
    num_train = num_tokens - num_val
    with temp_file('val.bin') as f:
      _split_tail(temps[0], num_train, dtype, f)
    meta = DatasetMeta(
        vocab_size=tok.vocab_size, dtype=dtype.name, train_tokens=num_train,
        val_tokens=num_val, tokenizer=tok.name, tokenizer_sha256=tok.sha256, sources=sources,
        num_files=counts['files'], skipped_files=counts['skipped'],
        input_bytes=counts['bytes'], val_fraction=float(val_fraction), max_bytes=max_bytes,
    )
    with temp_file(META) as f:
      f.write(meta.to_json().encode())
      _sync(f)
    _install(out_dir, *temps)
    temps.clear()
  finally:
    for path in temps:
      path.unlink(missing_ok=True)
    if made and not any(out_dir.iterdir()):
      out_dir.rmdir()
  report.done(out_dir, meta)
  return meta


def _write_tokens(f, tok, dtype, pieces, counts: dict[str, int], report) -> int:
  """Writes the tokens of text `pieces` to `f` (synced) and returns how many. Bytes map
  to tokens one to one, so they stream in fixed pieces (`_READ_CHUNK`)."""
  num_tokens = 0
  for data in pieces:
    ids = tok.encode(data)
    f.write(ids.astype(dtype).tobytes())
    num_tokens += len(ids)
    report.update(counts['bytes'], counts['files'], num_tokens)
  _sync(f)
  return num_tokens


def _check_arguments(val_fraction, max_bytes, min_val_tokens) -> None:
  if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not (
      0 <= val_fraction < 1):
    raise ValueError(f'val_fraction must be in [0, 1), got {val_fraction!r}')
  if max_bytes is not None and (
      isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
    raise ValueError(f'max_bytes must be a positive integer, got {max_bytes!r}')
  if isinstance(min_val_tokens, bool) or not isinstance(min_val_tokens, int) or (
      min_val_tokens < 0):
    raise ValueError(f'min_val_tokens must be a non-negative integer, got {min_val_tokens!r}')


def _inputs(inputs: list[Path] | None, max_bytes: int | None):
  """`(roots, suffix, sources, max_bytes)` of `prepare`'s inputs: the default corpus
  (the standard library's .py files, capped at DEFAULT_CORPUS_BYTES) for None."""
  if inputs is None:
    roots = [stdlib_dir()]
    max_bytes = DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes
    return roots, '.py', (f'python-stdlib:{roots[0]}',), max_bytes
  roots = [Path(p) for p in inputs]
  if not roots:
    raise ValueError('prepare needs at least one input file or directory')
  for root in roots:
    if not root.exists():
      raise ValueError(f'input {root} does not exist')
  return roots, None, tuple(str(p) for p in roots), max_bytes


def _sync(f) -> None:
  f.flush()
  os.fsync(f.fileno())


def _split_tail(train: Path, num_train: int, dtype: np.dtype, f) -> None:
  """The split is the stream's tail: copies it from `train` to `f`, then cuts it off."""
  all_tokens = np.memmap(train, dtype=dtype, mode='r')
  _copy(all_tokens[num_train:], f)
  _sync(f)
  del all_tokens
  os.truncate(train, num_train * dtype.itemsize)


def _install(out_dir: Path, train: Path, val: Path, meta: Path) -> None:
  """Moves the written files into place. meta.json goes first and comes back last: in
  between the directory is visibly incomplete rather than a mix of old and new files."""
  (out_dir / META).unlink(missing_ok=True)
  os.replace(train, out_dir / 'train.bin')
  os.replace(val, out_dir / 'val.bin')
  os.replace(meta, out_dir / META)
