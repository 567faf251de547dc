"""The disk tier's files (`dos_jax.Disk`): which a process holds, their names, and
reading and writing them outside the step.

Each disk subgroup has two files per device (`kernels.host_adamw_disk`), the halves of a
double buffer: generation `gen` lives in half `gen % 2` (`parity`). On a mesh every
device has its own (`live_path`: its data shard's columns, of its copy on the other
axes); a process writes only its own devices' (`local_files`), the first copy written
and the others hard-linked to it. The step reads and writes them in the native kernel
(`dos_jax.step.disk_tier`); the functions here are for the first generation,
checkpoints and restores.
"""

from __future__ import annotations

import errno
import os

import jax
import numpy as np

from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry import slots as slots_lib
from dos_jax.kernels import host_adamw_disk


def local_files(part: partition_lib.Partition, mesh) -> dict[int | None, list[int]]:
  """This process's files of each disk subgroup: by data shard (as `shard_ids` names
  it), the copies its devices hold (`file_index`'s numbering: a device's position on
  the mesh's other axes), ascending. Without a mesh, or on one device: `{None: [0]}`."""
  if file_count(part) == 1 or mesh is None:
    return {shard_ids(part)[0]: [0]}
  names = mesh.axis_names
  others = [k for k, a in enumerate(names) if a != part.disk_axis]
  axis = names.index(part.disk_axis)
  files: dict[int | None, list[int]] = {}
  for where, device in np.ndenumerate(mesh.devices):
    if device.process_index != jax.process_index():
      continue
    replica = int(np.ravel_multi_index([where[k] for k in others],
                                       [mesh.devices.shape[k] for k in others])) if others else 0
    files.setdefault(where[axis] if part.disk_shards > 1 else None, []).append(replica)
  return {shard: sorted(files[shard]) for shard in sorted(files, key=lambda s: s or 0)}


def write_local(part: partition_lib.Partition, g: int, parity: int, shard: int | None,
                replicas: list[int], cols: np.ndarray) -> None:
  """Data shard `shard`'s `(K, S / disk_shards)` columns of subgroup `g` written as the
  file of copy `replicas[0]`, the other `replicas` (this process's) linked to it."""
  host_adamw_disk.write_state(part.disk_dir, g, parity, np.ascontiguousarray(cols),
                              _file_index(part, shard, replicas[0]))
  link_local(part, g, parity, shard, replicas[1:], live_path(part, g, parity, shard,
                                                             replicas[0]))


def link_local(part: partition_lib.Partition, g: int, parity: int, shard: int | None,
               replicas: list[int], source: str) -> None:
  """The files of data shard `shard` of subgroup `g` in half `parity` of copies
  `replicas` linked to `source`."""
  for replica in replicas:
    target = live_path(part, g, parity, shard, replica)
    if target != source:
      link_or_copy(source, target)


def parity(gen) -> int:
  """The half of the double buffer generation `gen` (concrete) lives in, read from this
  process's copy of it (the same on every process)."""
  if isinstance(gen, jax.Array):
    gen = np.asarray(gen.addressable_data(0))
  return int(gen) % 2


def write_split_rows(part: partition_lib.Partition, gen, rows: jax.Array, mesh) -> None:
  """Each disk subgroup's files of this process's devices (`local_files`) at generation
  `gen`, from its addressable columns of the `(G, K, S)` `rows` split over the data axis
  (as `write_rows` from whole rows)."""
  width = rows.shape[2] // part.disk_shards
  columns = {}
  for shard in rows.addressable_shards:
    start = shard.index[2].start or 0
    columns.setdefault(start // width if part.disk_shards > 1 else None, shard.data)
  half = parity(gen)
  for g in part.disk:
    for data_shard, replicas in local_files(part, mesh).items():
      write_local(part, g, half, data_shard, replicas, np.asarray(columns[data_shard][g]))


def remove_file(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass


def shard_ids(part: partition_lib.Partition) -> list[int | None]:
  """The data shards whose columns each disk subgroup's files hold (`None`: one), as a
  checkpoint names them (`read_columns`)."""
  return [None] if part.disk_shards == 1 else list(range(part.disk_shards))


def live_path(part: partition_lib.Partition, g: int, parity: int, shard: int | None,
              replica: int = 0) -> str:
  """The file of data shard `shard`'s columns of subgroup `g` in half `parity` that
  the device of copy `replica` reads and writes (the kernel's `shard` is the file's
  index, `replica * disk_shards + shard`, among `file_count(part)`)."""
  return host_adamw_disk.state_path(part.disk_dir, g, parity, _file_index(part, shard, replica))


def file_count(part: partition_lib.Partition) -> int:
  return part.disk_shards * part.disk_replicas


def link_or_copy(source: str, target: str) -> None:
  """`target` made a hard link to `source` (a copy across file systems), replacing
  `target` atomically if it exists. The kernel replaces a file, never writes into one,
  so the link keeps `source`'s bytes."""
  tmp = target + '.tmp'
  if os.path.lexists(tmp):
    os.unlink(tmp)
  try:
    os.link(source, tmp)
  except OSError as err:
    if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
      raise
    with open(source, 'rb') as src, open(tmp, 'xb') as dst:
      while chunk := src.read(1 << 26):
        dst.write(chunk)
      dst.flush()
      os.fsync(dst.fileno())
  os.replace(tmp, target)


def write_rows(part: partition_lib.Partition, g: int, parity: int, rows: np.ndarray) -> None:
  """Subgroup `g`'s `(K, S)` state written as its files (one per data shard and copy:
  the first copy's written, the others linked to it)."""
  width = rows.shape[1] // part.disk_shards
  for shard in shard_ids(part):
    cols = rows if shard is None else rows[:, shard * width:(shard + 1) * width]
    write_local(part, g, parity, shard, list(range(part.disk_replicas)), cols)


def _file_index(part: partition_lib.Partition, shard: int | None,
                replica: int = 0) -> int | None:
  return None if file_count(part) == 1 else replica * part.disk_shards + (shard or 0)


def read_rows(part: partition_lib.Partition, slots: slots_lib.Slots, size: int,
              gen) -> dict[int, np.ndarray]:
  """Each disk subgroup's `(K, S)` float32 state at generation `gen` (concrete), by
  subgroup, from the first copy's files: for inspection and checkpoints, not for the
  training step."""
  half, k = parity(gen), slots.group_sizes[0]
  files = [_file_index(part, shard) for shard in shard_ids(part)]
  return {g: _read_columns(part.disk_dir, g, half, k, size, files) for g in part.disk}


def read_columns(directory: str, g: int, num_slots: int, size: int, shards: int,
                 start: int, stop: int) -> np.ndarray:
  """Columns `[start, stop)` of subgroup `g`'s `(K, S)` state in half 0, kept as the
  files of `shards` data shards: only the files that hold them are read."""
  if shards == 1:
    return _read_columns(directory, g, 0, num_slots, size, [None])[:, start:stop]
  width = size // shards
  first, last = start // width, (stop - 1) // width
  cols = _read_columns(directory, g, 0, num_slots, (last - first + 1) * width,
                       list(range(first, last + 1)))
  return cols[:, start - first * width:stop - first * width]


def _read_columns(directory: str, g: int, parity: int, num_slots: int, size: int,
                  files: list[int | None]) -> np.ndarray:
  """Subgroup `g`'s `(K, S)` state from `files` (their indices), each holding the next
  `S / len(files)` columns."""
  width = size // len(files)
  return np.concatenate([host_adamw_disk.read_state(directory, g, parity, num_slots, width, f)
                         for f in files], axis=1)
