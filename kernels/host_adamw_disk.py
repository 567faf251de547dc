"""Native AdamW over subgroups whose fp32 state lives in files (the disk tier).

Subgroup g's state, K rows of S float32 (master when params are 16-bit, mu, nu: the
rows of the stacked state, see `dos_jax.geometry.slots`), is the file
`{directory}/sg{g:06d}.{h}` (`state_path`): row-major `(K, S)`, zero-padded to a
multiple of 4096 bytes (`file_bytes`). There are two halves, h = 0 and 1. The step at
generation `gen` reads half `gen % 2` and writes half `(gen + 1) % 2`, returning
`gen + 1`; the program carries only that int32. Each new file is written to
`{path}.tmp`, synced, then renamed over `{path}`, and the directory is synced after the
last subgroup: the current half is never modified (a step that fails leaves the state
at `gen`), and a hard link to an older file (a checkpoint) keeps its bytes.

`adamw_disk_rows` runs the update (host_adamw_disk.cc): the row loop of
`adamw_host_rows`, so the same bits, pipelined so that the disk's bandwidth bounds it.
`write_state` / `read_state` are the numpy side, for the first state, checkpoints and
tests.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.kernels import _native
from dos_jax.kernels import adamw_scalars
from dos_jax.kernels import plugin_kernel
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import check_threads_and_isa
from dos_jax.kernels.host_adamw import GRAD_DTYPES
from dos_jax.kernels.host_adamw import LOWP_DTYPES
from dos_jax.kernels.host_adamw import HostIsa

_TARGET = 'dos_jax_adamw_disk_rows'
_PAGE = 4096  # file padding, and the alignment direct I/O needs



@functools.cache
def _load() -> tuple[Any, str]:
  """Imports the native module and registers its FFI target; (module, '') or (None, why)."""
  return _native.load('_host_adamw_disk', {_TARGET: 'handler'}, 'native disk AdamW')


def disk_kernel_available() -> bool:
  """Whether the native disk AdamW is built, loadable and registered."""
  return _load()[0] is not None


def disk_kernel_unavailable_reason() -> str:
  """Why `disk_kernel_available()` is False ('' when it is True)."""
  return _load()[1]


# The handler's standing inside GPU plugins: registered there for the accelerator
# program's host regions and proved by a probe compile (no fallback: the disk tier
# refuses in one line where the plugin does not take it).
_PLUGIN = plugin_kernel.PluginKernel(_load, {_TARGET: 'handler'})


def disk_kernel_in_two_memory_programs() -> tuple[bool, str]:
  """Whether a two-memory program traced now may call the disk kernel in its host
  regions: `(ok, why not)`. On a GPU (or compiling for one without a GPU, after
  `register_for_gpu_compile`), whether the CUDA plugin took the handler; on the CPU
  backend, whether the kernel loads."""
  return _PLUGIN.in_two_memory_programs()


def register_for_gpu_compile() -> tuple[bool, str]:
  """Registers the handler in the CUDA plugin for compiling GPU programs without a GPU
  and proves it took it: `(True, '')` or `(False, why)`. Done once per process."""
  return _PLUGIN.register_for_gpu_compile()


def state_path(directory: str, g: int, parity: int, shard: int | None = None) -> str:
  """The file of subgroup `g`'s state in half `parity` (0 or 1); with `shard`, that of
  one data shard (its columns of the rows) of a state split over several devices."""
  if parity not in (0, 1):
    raise ValueError(f'parity must be 0 or 1, got {parity!r}')
  if int(g) < 0:
    raise ValueError(f'subgroup ids are non-negative, got {g}')
  part = '' if shard is None else f'.s{int(shard):03d}'
  return os.path.join(os.fspath(directory), f'sg{int(g):06d}{part}.{parity}')


# The names `state_path` gives (and a `.tmp` a write in progress leaves).
STATE_FILE = re.compile(r'sg\d{6}(\.s\d{3})?\.[01](\.tmp)?')


def file_bytes(num_slots: int, size: int) -> int:
  """Bytes of one state file: `num_slots * size` float32, padded to a multiple of 4096."""
  return -(-num_slots * size * 4 // _PAGE) * _PAGE


def _sync_directory(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_state(directory: str, g: int, parity: int, rows: np.ndarray,
                shard: int | None = None) -> None:
  """Writes subgroup `g`'s `(K, S)` float32 state as its file in half `parity`,
  atomically: into `{path}.tmp` (a new file), synced, renamed over `{path}`; then the
  directory is synced. A hard link to the file it replaces keeps the old bytes."""
  rows = np.asarray(rows)
  if rows.ndim != 2 or rows.dtype != np.float32:
    raise ValueError(f'rows must be float32 (K, S), got {rows.dtype}{list(rows.shape)}')
  path = state_path(directory, g, parity, shard)
  tmp = path + '.tmp'
  try:
    os.unlink(tmp)  # a stale one: never write into a file that may have other links
  except FileNotFoundError:
    pass
  data = np.ascontiguousarray(rows)
  with open(tmp, 'xb') as f:
    f.write(memoryview(data).cast('B'))
    f.write(bytes(file_bytes(*rows.shape) - data.nbytes))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _sync_directory(os.path.dirname(path) or '.')


def read_state(directory: str, g: int, parity: int, num_slots: int, size: int,
               shard: int | None = None) -> np.ndarray:
  """Subgroup `g`'s `(num_slots, size)` float32 state from its file in half `parity`.

  Raises:
    FileNotFoundError: there is no such file.
    ValueError: the file's size is not `file_bytes(num_slots, size)`.
  """
  path = state_path(directory, g, parity, shard)
  found, want = os.stat(path).st_size, file_bytes(num_slots, size)
  if found != want:
    raise ValueError(f'{path} has {found} bytes, expected {want} for a ({num_slots}, {size}) '
                     'float32 state padded to 4096')
  return np.fromfile(path, np.float32, count=num_slots * size).reshape(num_slots, size)


def _check(gen, grads, params, subgroups, slots, num_slots, lowp_dtype) -> None:
  """Raises a one-line error naming the argument that breaks the contract."""
  if jnp.ndim(gen) != 0 or not jnp.issubdtype(jnp.result_type(gen), jnp.integer):
    raise ValueError(f'gen must be an integer scalar, got {jnp.result_type(gen)}'
                     f'{list(jnp.shape(gen))}')
  if (len(set(subgroups)) != len(subgroups)) or any(g < 0 for g in subgroups):
    raise ValueError(f'subgroups must be distinct non-negative ints, got {list(subgroups)}')
  rows = len(subgroups)
  if grads.ndim != 2 or grads.shape[0] != rows or grads.dtype not in GRAD_DTYPES:
    raise ValueError(f'grads must be f32 or bf16 (D, S), D = len(subgroups) = {rows}, got '
                     f'{grads.dtype}{list(grads.shape)}')
  size = grads.shape[1]
  if not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
    raise ValueError(f'num_slots must be a positive int, got {num_slots!r}')
  master_k, mu_k, nu_k = slots
  used = [s for s in slots if s >= 0]
  if len(set(used)) != len(used) or any(s >= num_slots for s in used) or min(mu_k, nu_k) < 0:
    raise ValueError(f'slots={slots} must be distinct rows in [0, {num_slots}) '
                     '(master may be -1)')
  if jnp.dtype(lowp_dtype) not in LOWP_DTYPES:
    raise ValueError(f'lowp_dtype must be float32, bfloat16 or float16, got {lowp_dtype}')
  if master_k < 0:
    if params is None or params.shape != (rows, size) or params.dtype != jnp.float32:
      got = None if params is None else f'{params.dtype}{list(params.shape)}'
      raise ValueError(f'without a master slot, params must be f32 {(rows, size)} '
                       f'like grads, got {got}')
    if jnp.dtype(lowp_dtype) != jnp.float32:
      raise ValueError(f'without a master slot the out rows are the f32 update; '
                       f'lowp_dtype must be float32, got {jnp.dtype(lowp_dtype)}')


def _arguments(gen, grads, params, subgroups, directory, slots, num_slots, lowp_dtype,
               shards) -> tuple[list[int], str, tuple[int, ...]]:
  """The call's checked arguments: (subgroup ids, absolute directory, slots)."""
  subgroups = [int(g) for g in subgroups]
  directory = os.fspath(directory)
  if not directory:
    raise ValueError('directory must not be empty')
  slots = tuple(int(s) for s in slots)
  _check(gen, grads, params, subgroups, slots, num_slots, lowp_dtype)
  if not isinstance(shards, (int, np.integer)) or shards < 1:
    raise ValueError(f'shards must be a positive int, got {shards!r}')
  return subgroups, os.path.abspath(directory), slots


def adamw_disk_rows(gen, grads, params, scalars: AdamWScalars, *, directory: str,
                    subgroups: Sequence[int], slots: tuple[int, int, int], num_slots: int,
                    decayed_rows: int, lowp_dtype: Any, nesterov: bool = False,
                    num_threads: int | None = None, isa: HostIsa = HostIsa.AUTO,
                    direct_io: bool = True, shard=None, shards: int = 1):
  """One AdamW step on subgroups whose state is in files; the same bits as
  `adamw_host_rows` on that state in memory.

  Reads each subgroup's state in half `gen % 2` and writes it to half `(gen + 1) % 2`
  (the module's docstring); a side effect, so under jit it runs on every step.

  Args:
    gen: int32 scalar, the current generation (>= 0).
    grads: f32 or bf16 `(D, S)` gradient rows, row j belonging to `subgroups[j]`.
    params: the f32 `(D, S)` param rows without a master slot; None with one.
    scalars: the step's `AdamWScalars`.
    directory: where the state files are (made absolute now).
    subgroups: the D distinct subgroup ids (file ids) of the rows.
    slots: `(master_k, mu_k, nu_k)`, rows of each file's `(K, S)` state; master_k = -1
      when params are fp32 and there is no master.
    num_slots: K, the rows of each file.
    decayed_rows: subgroups whose id is below this get weight decay.
    lowp_dtype: dtype of the out rows: the new master cast to it (bf16, f16 or f32),
      or, without a master, float32 (the out rows are the update).
    nesterov: Nesterov momentum (needs `scalars.bc1_next`).
    num_threads: threads per subgroup (default: the cores), beside a reader and a writer.
    isa: instruction set of the loop; all give identical results.
    direct_io: O_DIRECT reads and writes (buffered where the filesystem refuses it).
    shard, shards: a state split over `shards` devices: this call's data shard (an
      int32 scalar, e.g. `lax.axis_index`), whose files hold its columns of the rows.

  Returns:
    `(out, new_gen)`: the `(D, S)` out rows in `lowp_dtype` and `gen + 1`.

  Raises:
    RuntimeError: the native library is missing (`disk_kernel_available()` is False);
    at run time, naming the file, on an I/O error or a missing or short file (the
    current half then untouched).

  Example (a first step, from a master of ones):

  >>> import tempfile, jax.numpy as jnp, numpy as np
  >>> from dos_jax.kernels import AdamWScalars
  >>> from dos_jax.kernels import host_adamw_disk as disk
  >>> directory = tempfile.mkdtemp()
  >>> for g in (0, 7):  # (master, mu, nu) of ones, zeros, zeros
  ...   disk.write_state(directory, g, 0, np.eye(1, 3).T.repeat(4, 1).astype(np.float32))
  >>> scalars = AdamWScalars(lr=0.25, b1=0.9, b2=0.999, eps=0.0, eps_root=0.0,
  ...                        weight_decay=0.0, bc1=1 - 0.9, bc2=1 - 0.999)
  >>> out, gen = disk.adamw_disk_rows(
  ...     0, jnp.full((2, 4), -3.0), None, scalars, directory=directory, subgroups=(0, 7),
  ...     slots=(0, 1, 2), num_slots=3, decayed_rows=0, lowp_dtype=jnp.bfloat16)
  >>> int(gen), out[1].tolist()  # Adam's first step moves each weight by lr
  (1, [1.25, 1.25, 1.25, 1.25])
  >>> disk.read_state(directory, 7, 1, 3, 4)[0].tolist()  # the new master, in half 1
  [1.25, 1.25, 1.25, 1.25]
  >>> disk.read_state(directory, 7, 0, 3, 4)[0].tolist()  # half 0 is as it was
  [1.0, 1.0, 1.0, 1.0]
  >>> import shutil; shutil.rmtree(directory)
  """
  if not disk_kernel_available():
    raise RuntimeError(disk_kernel_unavailable_reason())
  subgroups, directory, slots = _arguments(gen, grads, params, subgroups, directory, slots,
                                           num_slots, lowp_dtype, shards)
  master_k, mu_k, nu_k = slots
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  if master_k >= 0:  # the master is in the files
    params = jnp.zeros((0,), jnp.float32)
  rows, size = grads.shape
  call = jax.ffi.ffi_call(
      _TARGET,
      (jax.ShapeDtypeStruct((rows, size), jnp.dtype(lowp_dtype)),
       jax.ShapeDtypeStruct((), jnp.int32)),
      has_side_effect=True)
  shard = jnp.zeros((), jnp.int32) if shard is None else jnp.asarray(shard, jnp.int32)
  out, new_gen = call(
      jnp.asarray(gen, jnp.int32), shard, grads, params, packed, directory=directory,
      subgroups=np.asarray(subgroups, np.int64), K=np.int64(num_slots),
      master_k=np.int64(master_k), mu_k=np.int64(mu_k), nu_k=np.int64(nu_k),
      decayed_rows=np.int64(decayed_rows), num_threads=np.int64(threads),
      nesterov=bool(nesterov), isa=np.int64(int(isa)), direct_io=bool(direct_io),
      shards=np.int64(shards))
  return out, new_gen
