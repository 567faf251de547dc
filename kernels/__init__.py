"""Update kernels: a Pallas fused AdamW for the device path, a native AdamW for the host path.

All three implementations share one contract: a flat subgroup of fp32 master weights,
m and v and a gradient, the step's `AdamWScalars`, a weight-decay boundary and a
low-precision dtype; they return (new_master, new_mu, new_nu, new_lowp), the first
three aliased to their inputs. `adamw_host_rows` / `adamw_host_leaves` update listed
subgroup rows of the core's stacked `(G, K, S)` state in place, in one call.
"""

from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import adamw_host
from dos_jax.kernels.host_adamw import default_num_threads
from dos_jax.kernels.host_adamw import host_kernel_available
from dos_jax.kernels.host_adamw import host_kernel_unavailable_reason
from dos_jax.kernels.host_adamw import HostIsa
from dos_jax.kernels.host_adamw import supported_isas
from dos_jax.kernels.host_adamw_rows import adamw_host_leaves
from dos_jax.kernels.host_adamw_rows import adamw_host_rows
from dos_jax.kernels.host_adamw_rows import host_kernel_in_gpu_programs
from dos_jax.kernels.host_adamw_rows import rows_kernel_available
from dos_jax.kernels.pallas_adamw import adamw_pallas
from dos_jax.kernels.pallas_adamw import adamw_pallas_rows
from dos_jax.kernels.pallas_adamw import adamw_reference
from dos_jax.kernels.pallas_adamw import BlockConfig
from dos_jax.kernels.pallas_adamw import DEFAULT_CONFIG
