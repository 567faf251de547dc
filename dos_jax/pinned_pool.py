"""XLA's pinned-host pool on GPU: how large it is, and whether the offloaded state fits.

XLA's GPU client serves every `pinned_host` buffer of a process (the optimizer state,
host-bound gradients, the host update's new parameters) from one pool, capped at
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB (default 64), read once when the client starts.
The pool grows on demand, so a generous cap costs nothing; a small one ends a run with
an allocator error deep in XLA ("Out of host memory ... xla_gpu_host_bfc"), e.g. the
7B model's 76 GiB of fp32 Adam state on one GPU.

Two users:
- `dos-jax train` (or a user's script: `dos_jax.size_pinned_pool`) sets the variable,
  before JAX starts a backend, to what its plan puts in pinned host memory per process
  (`set_default`, `required_gib`), and on a GPU refuses a smaller value the user set
  (`dos_jax.check_pinned_pool`).
- The offloaded transforms' `init` on a GPU backend compares the state's pinned bytes
  with the limit in force (`check_init`) before allocating anything.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax

from dos_jax.geometry import layout as layout_lib
from dos_jax import meshes
from dos_jax.implementation import Implementation
from dos_jax.implementation import Program
from dos_jax.offload import Offload

ENV_VAR = 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'
# XLA's default when the variable is unset (se_gpu_pjrt_client.cc: 64 << 30 bytes).
DEFAULT_GIB = 64
# Beyond the plan's figure: fragmentation of XLA's BFC pool and transfer staging.
MARGIN_FRACTION = 0.05
MARGIN_GIB = 2
_GIB = 2**30


class PinnedPoolError(ValueError):
  """The pinned-host pool cap is smaller than the offloaded state needs (one line)."""


def limit_in_force(environ: Any = None) -> tuple[int, bool]:
  """`(GiB, set_by_user)`: the cap the GPU client uses (or will use) in this process.

  Raises:
    PinnedPoolError: the variable is set but is not a positive whole number of GiB
      (XLA reads it as an integer and falls back to its default otherwise).
  """
  environ = os.environ if environ is None else environ
  text = environ.get(ENV_VAR)
  if text is None or not text.strip():
    return DEFAULT_GIB, False
  try:
    value = int(text.strip())
  except ValueError:
    value = 0
  if value < 1:
    raise PinnedPoolError(f'{ENV_VAR}={text!r}: expected a positive whole number of GiB')
  return value, True


def required_gib(pinned_bytes: float) -> int:
  """The cap (whole GiB, as XLA reads it) for `pinned_bytes` of pinned host buffers
  per process, with the margin; 0 when nothing is pinned."""
  if pinned_bytes <= 0:
    return 0
  return math.ceil(pinned_bytes * (1 + MARGIN_FRACTION) / _GIB) + MARGIN_GIB


def check_limit(pinned_bytes: float, limit_gib: int, *, what: str) -> None:
  """Raises PinnedPoolError (one line naming the variable and the value needed) when
  `pinned_bytes` plus the margin exceeds a cap of `limit_gib`."""
  needed = required_gib(pinned_bytes)
  if needed > limit_gib:
    raise PinnedPoolError(
        f'{ENV_VAR}={limit_gib} is too small: {what} needs {pinned_bytes / _GIB:,.1f} GiB'
        f' of pinned host memory in this process; set {ENV_VAR}={needed} (or more)'
        ' before JAX starts')


def set_default(pinned_bytes: float, environ: Any = None) -> int:
  """What `dos-jax train` does before any backend starts: where the user left the cap
  unset and XLA's default is too small, sets it to `required_gib(pinned_bytes)`; a value
  the user set is kept (and checked once the backend is known to be a GPU: on CPU it
  means nothing). Returns the cap in force; touches no backend.

  Raises:
    PinnedPoolError: the user's value is not a positive whole number.
  """
  environ = os.environ if environ is None else environ
  limit, set_by_user = limit_in_force(environ)
  needed = required_gib(pinned_bytes)
  if not set_by_user and needed > limit:
    environ[ENV_VAR] = str(needed)
    return needed
  return limit


def size_pinned_pool(pinned_bytes: float) -> int:
  """Makes XLA's pinned-host pool large enough for `pinned_bytes` per process.

  Call it before JAX starts a backend (the GPU client reads the cap once): where
  `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` is unset and XLA's default (64 GiB) is too small
  for `pinned_bytes` plus a margin, it sets the variable; a value the user set is kept
  (`check_pinned_pool` checks it once a GPU backend runs). Touches no backend.

  Args:
    pinned_bytes: pinned host bytes the process will hold (e.g. the optimizer state's
      host and streamed tiers, `state_pinned_bytes`).

  Returns:
    The cap in force, in GiB.

  Raises:
    PinnedPoolError: the user's value is not a positive whole number.
  """
  return set_default(pinned_bytes)


def check_pinned_pool(pinned_bytes: float, *, what: str = 'the optimizer state') -> None:
  """Raises PinnedPoolError (one line: the variable, the value needed) when the pinned
  pool cap in force is too small for `pinned_bytes`, named `what` in the message."""
  limit, _ = limit_in_force()
  check_limit(pinned_bytes, limit, what=what)


def state_pinned_bytes(params: Any, offload: Offload, mask: Any = None,
                       mu_bytes: int = 4, *,
                       implementation: Implementation | None = None) -> float:
  """Pinned host bytes of the state `init(params)` will allocate in this process: the
  host and streamed tiers of the plan the policy gives at `init` (and, on the
  two-memory program, the one `implementation` names or the backend's, the most the
  early host calls' undo can take), each device's shard of the data axis counted once
  per addressable device."""
  implementation = Implementation() if implementation is None else implementation
  mesh = meshes.find_mesh(params, offload)
  shards = mesh.shape[offload.data_axis] if mesh is not None else 1
  layout = layout_lib.make_layout(
      params, offload.subgroup_size, decay_flags=layout_lib.resolve_mask(mask, params),
      shard_multiple=shards)
  spec = layout.spec()  # The spec `init` plans from (the same policy call, cached).
  plan = offload.policy.plan(spec)
  state_bytes = spec.state_bytes_per_element - 4 + mu_bytes
  rows = len(plan.streamed) + len(plan.host)
  if implementation.target() is Program.TWO_MEMORIES and len(plan.host) > 1:
    # Early host calls may keep an undo of every host subgroup's state but the last's:
    # the kernel library's own (pageable) memory, not the pool's, yet counted here,
    # which errs on the safe side of the pool.
    rows += len(plan.host) - 1
  pinned = rows * spec.subgroup_size * state_bytes / shards
  local = 1
  if mesh is not None:
    devices = getattr(mesh, 'devices', None)
    if devices is not None:
      local = sum(d.process_index == jax.process_index() for d in devices.flat)
  return float(pinned * local)


def _on_gpu(params: Any) -> bool:
  for leaf in jax.tree.leaves(params):
    sharding = meshes.leaf_sharding(leaf)
    devices = getattr(sharding, 'device_set', None)
    if devices:
      return next(iter(devices)).platform == 'gpu'
  return jax.default_backend() == 'gpu'


def check_init(params: Any, offload: Offload, mask: Any = None, mu_bytes: int = 4,
               *, implementation: Implementation | None = None,
               on_gpu: bool | None = None, environ: Any = None) -> None:
  """`init`'s check on a GPU backend (`on_gpu` None: the params' devices, else the
  default backend): the pinned bytes of the state (`state_pinned_bytes`) against the
  cap in force.

  Raises:
    PinnedPoolError: one line naming `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` and the value
      needed.
  """
  if not (_on_gpu(params) if on_gpu is None else on_gpu):
    return
  limit, _ = limit_in_force(environ)
  check_limit(state_pinned_bytes(params, offload, mask, mu_bytes,
                                 implementation=implementation), limit,
              what="the optimizer state's host tiers")
