"""Keep freed host memory in the process for reuse, instead of returning it to the OS.

Why: on the CPU backend every large buffer of a jitted call (the host AdamW's new
parameter rows, the update rows of the optax API, a program's large temporaries) is a
fresh allocation. glibc serves a request above 32 MiB with a new `mmap` and returns it
with `munmap` when freed, so every step the kernel faults in and zeroes those pages
again; and a request from one of XLA's worker threads, whose malloc arena can only grow
in 64 MiB heaps, is mmapped whatever the settings. For a 64M-parameter update that
zeroing is a quarter to a third of the update's time (experiments/RESULTS.md, section
5). With one arena, no per-allocation mappings and no trimming, the next step's buffer
is an already-touched one, as the GPU client's pinned-host pool gives a GPU program's
host regions.

This is a process-wide allocator setting, so the library never applies it on import;
`dos-jax train` applies it for its own process (`offload.keep_freed_host_memory`), and
a library user may call `keep_freed_host_memory()` first thing, before JAX runs any
computation (threads that already have an arena keep it). It changes where memory
comes from, not how much a step needs: a training loop allocates the same sizes every
step, so its footprint stays the same, while memory freed by a large one-off array is
held by the process until it exits. Small allocations from many threads share one
arena's lock; glibc's per-thread caches serve most of them without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Largest trim threshold mallopt accepts (an int): free heap at the top is kept.
_NEVER_TRIM = 2**31 - 1


def keep_freed_host_memory() -> bool:
  """Serves large allocations from the heap and keeps freed ones there for reuse.

  Sets glibc's `M_ARENA_MAX` to 1 (threads allocate from the main heap, which can
  hold any size), `M_MMAP_MAX` to 0 (no allocation gets its own mapping) and
  `M_TRIM_THRESHOLD` to its maximum (freed memory at the top of the heap stays).

  Returns:
    True when applied; False where the C library is not glibc (musl, macOS, Windows),
    where nothing is changed.
  """
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return False
  libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
  # mallopt returns 1 on success.
  return all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
