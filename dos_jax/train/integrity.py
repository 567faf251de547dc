"""Checksum manifests of checkpoints: written after a save completes, verified on restore.

Orbax makes a checkpoint appear only once it is complete (a rename), but it cannot see
what happens to the files afterwards: a flipped bit or a truncated file restores
silently or ends in a deep traceback. Each checkpoint directory therefore gets a small
`dos_jax_manifest.json`, written atomically (temporary file, then rename) once orbax has
finished, holding the sha256 and size of every file in it and the run identity the
resume check compares. A checkpoint without a manifest is incomplete (the process died
between orbax's commit and the manifest); one whose files do not match it is corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

MANIFEST = 'dos_jax_manifest.json'
FORMAT = 1
_CHUNK = 4 * 2**20


class CheckpointDamaged(Exception):
  """A checkpoint is incomplete or corrupt; `str(err)` says which file and how."""


def _files(step_dir: str) -> list[str]:
  """Paths of every regular file under `step_dir`, relative and sorted, manifest excluded."""
  found = []
  for root, dirnames, filenames in os.walk(step_dir):
    dirnames.sort()
    for name in filenames:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel != MANIFEST and not name.startswith(f'.{MANIFEST}.'):
        found.append(rel)
  return sorted(found)


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def write_manifest(step_dir: str, *, step: int, run: dict[str, Any] | None) -> None:
  """Hashes every file of a finished checkpoint and writes its manifest atomically."""
  files = {
      rel: {'sha256': file_sha256(os.path.join(step_dir, rel)),
            'bytes': os.path.getsize(os.path.join(step_dir, rel))}
      for rel in _files(step_dir)
  }
  record = {'format': FORMAT, 'step': step, 'run': run, 'files': files}
  fd, tmp = tempfile.mkstemp(prefix=f'.{MANIFEST}.', suffix='.tmp', dir=step_dir)
  try:
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def has_manifest(step_dir: str) -> bool:
  return os.path.isfile(os.path.join(step_dir, MANIFEST))


def read_manifest(step_dir: str) -> dict[str, Any]:
  """The manifest of `step_dir`; CheckpointDamaged if it is missing or unreadable."""
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.isfile(path):
    raise CheckpointDamaged('incomplete: no checksum manifest (the save did not finish)')
  try:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise CheckpointDamaged(f'corrupt: unreadable {MANIFEST} ({type(err).__name__})') from None
  if (not isinstance(record, dict) or record.get('format') != FORMAT
      or not isinstance(record.get('files'), dict)):
    raise CheckpointDamaged(f'corrupt: {MANIFEST} is not a format-{FORMAT} manifest')
  return record


def verify(step_dir: str) -> dict[str, Any]:
  """Checks every file against the manifest; returns the manifest, or raises
  CheckpointDamaged naming the first file that is missing, resized, changed or extra."""
  record = read_manifest(step_dir)
  expected = record['files']
  present = set(_files(step_dir))
  for rel in sorted(expected):
    path = os.path.join(step_dir, rel)
    if rel not in present:
      raise CheckpointDamaged(f'incomplete: {rel} is missing')
    if os.path.getsize(path) != expected[rel].get('bytes'):
      raise CheckpointDamaged(
          f'corrupt: {rel} has {os.path.getsize(path)} bytes, the manifest says'
          f' {expected[rel].get("bytes")}'
      )
    if file_sha256(path) != expected[rel].get('sha256'):
      raise CheckpointDamaged(f'corrupt: {rel} fails its sha256 checksum')
  extra = sorted(present - set(expected))
  if extra:
    raise CheckpointDamaged(f'corrupt: {extra[0]} is not in the manifest')
  return record
