"""The records of a W&B run file (`run-<id>.wandb`), parsed with wandb's own protobuf.

wandb (>= 0.2x) ships no Python reader of its run files any more (its Go core writes
and syncs them); the file is a LevelDB log (google/leveldb doc/log_format.md, wandb's
`:W&B` header, zlib CRC-32 per chunk, as wandb's own `datastore` reader checked it)
of serialized `wandb.proto.wandb_internal_pb2.Record`s. This module undoes the framing,
checking each chunk's CRC, and leaves every field to wandb's `Record`.
"""

import glob
import json
import os
import struct
import zlib

from wandb.proto import wandb_internal_pb2

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_CRC = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}


def records(path: str) -> list:
  """Every `Record` of the run file at `path`, in order."""
  with open(path, 'rb') as f:
    raw = f.read()
  ident, magic, version = struct.unpack('<4sHB', raw[:_HEADER])
  assert (ident, magic, version) == (b':W&B', 0xBEE1, 0), (ident, magic, version)
  out, at, pending = [], _HEADER, b''
  while at + _HEADER <= len(raw):
    if _BLOCK - at % _BLOCK < _HEADER:  # the block's trailer: zeros
      at += _BLOCK - at % _BLOCK
      continue
    checksum, length, kind = struct.unpack('<IHB', raw[at:at + _HEADER])
    if kind == 0 and length == 0:
      break  # preallocated, unwritten
    data = raw[at + _HEADER:at + _HEADER + length]
    assert zlib.crc32(data, _CRC[kind]) == checksum, f'chunk at {at}: bad checksum'
    at += _HEADER + length
    pending += data
    if kind in (_FULL, _LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
      pending = b''
  return out


def run_files(wandb_dir: str) -> list[str]:
  """The run files under a `wandb/` folder, oldest first."""
  return sorted(glob.glob(os.path.join(wandb_dir, '*run-*', 'run-*.wandb')))


def history(path: str) -> dict[int, dict]:
  """{step: {key: value}} of a run file's history records (rows of one step merged)."""
  rows: dict[int, dict] = {}
  for record in records(path):
    if record.WhichOneof('record_type') == 'history':
      items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json)
               for i in record.history.item}
      step = record.history.step.num
      rows.setdefault(step, {}).update(items)
  return rows


def first(path: str, kind: str):
  """The first record of `kind` ('run', 'summary', ...) in a run file, or None."""
  return next((getattr(r, kind) for r in records(path) if r.WhichOneof('record_type') == kind),
              None)
