"""The AdamW kernels: the Pallas AdamW for the device path, the native host AdamW for the host path.

Both update a subgroup's AdamW state in place, from the step's `AdamWScalars`, a
weight-decay boundary and a low-precision dtype. `adamw_pallas_rows` takes one
subgroup's `(K, S)` block; `adamw_host_rows` / `adamw_host_leaves` update listed
subgroup rows of the core's stacked `(G, K, S)` state in one call. `adamw_reference`
is the pure-jnp step both agree with.
"""

from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import default_num_threads
from dos_jax.kernels.host_adamw import HostIsa
from dos_jax.kernels.host_adamw import supported_isas
from dos_jax.kernels.host_adamw_rows import adamw_host_leaves
from dos_jax.kernels.host_adamw_rows import adamw_host_rows
from dos_jax.kernels.host_adamw_rows import host_kernel_in_gpu_programs
from dos_jax.kernels.host_adamw_rows import rows_kernel_available
from dos_jax.kernels.pallas_adamw import adamw_pallas_rows
from dos_jax.kernels.pallas_adamw import adamw_reference
from dos_jax.kernels.pallas_adamw import BlockConfig
from dos_jax.kernels.pallas_adamw import DEFAULT_CONFIG

# Kernels over flat arrays that only benchmarks used; they left the library.
_MOVED = {
    'adamw_pallas': 'the flat Pallas AdamW is experiments/pallas_adamw_flat.py (a benchmark '
                    "variant); the library's kernel is adamw_pallas_rows",
    'adamw_host': 'the flat native host AdamW was removed (a benchmark variant); use '
                  'adamw_host_rows, the kernel the library runs',
    'host_kernel_available': 'the flat native host AdamW was removed; use '
                             'rows_kernel_available',
    'host_kernel_unavailable_reason': 'the flat native host AdamW was removed; use '
                                      'host_adamw_rows.rows_kernel_unavailable_reason',
}


def __getattr__(name: str):
  if name in _MOVED:
    raise AttributeError(f'dos_jax.kernels.{name} is gone: {_MOVED[name]}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
