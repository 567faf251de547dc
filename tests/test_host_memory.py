"""keep_freed_host_memory: a large buffer, once freed, is served again from the heap
instead of a fresh mapping (whose pages the OS faults in and zeroes on every step),
also when a thread other than the main one allocates it, as XLA's workers do.

Checked through glibc's own accounting (mallinfo2) in a fresh process, since the
setting is process-wide: without it a 128 MB allocation is mmapped (hblkhd) and the
heap stays small; with it the heap (arena) holds the buffer and keeps it after free.
"""

import platform
import subprocess
import sys

import pytest

_PROBE = '''
import ctypes, sys, threading
from dos_jax import host_memory
class MallInfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in (
      'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
      'fordblks', 'keepcost')]
libc = ctypes.CDLL('libc.so.6')
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = host_memory.keep_freed_host_memory() if sys.argv[1] == 'keep' else False
n = 128 << 20
seen = {}
def work():  # In a thread of its own, as XLA's worker threads allocate.
  p = libc.malloc(n)
  ctypes.memset(p, 1, n)
  seen['during'] = libc.mallinfo2()
  libc.free(p)
  seen['after'] = libc.mallinfo2()
t = threading.Thread(target=work)
t.start()
t.join()
during, after = seen['during'], seen['after']
print(applied, during.hblkhd, during.arena, after.arena)
'''

pytestmark = pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc', reason='glibc only')


def _probe(mode: str) -> tuple[bool, int, int, int]:
  out = subprocess.run([sys.executable, '-c', _PROBE, mode], capture_output=True, text=True,
                       check=True, timeout=60).stdout.split()
  return out[0] == 'True', int(out[1]), int(out[2]), int(out[3])


def test_default_allocator_maps_and_unmaps_large_buffers():
  applied, mapped, heap, heap_after = _probe('default')
  assert not applied
  assert mapped >= 128 << 20
  assert heap < 128 << 20 and heap_after < 128 << 20


def test_kept_memory_serves_large_buffers_from_the_heap_and_keeps_them():
  applied, mapped, heap, heap_after = _probe('keep')
  assert applied
  assert mapped < 128 << 20
  assert heap >= 128 << 20
  assert heap_after >= 128 << 20  # Freed, not returned: the next step reuses it.
