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
