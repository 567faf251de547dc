"""The XLA options dos_jax's GPU programs are compiled with.

`GPU_COMPILER_OPTIONS` turns on XLA's latency-hiding scheduler, which places each
asynchronous copy and host call by a cost model: gradient copies to host memory run
while the backward pass goes on, and the device update runs while the host call
computes. XLA's default GPU schedule issues every copy's done right after its start and
runs the host call and the device update one after the other (the schedules compiled
for an H100 are in experiments/RESULTS.md; tests/test_compiled_gpu.py checks them).

The runner compiles its steps with these on a GPU. A library user passes them to jit:

    step = jax.jit(step, donate_argnums=(0, 1), compiler_options=dos_jax.GPU_COMPILER_OPTIONS)

They are XLA:GPU options: the CPU backend rejects them, so pass them only on a GPU.
"""

from typing import Any, Mapping
import types

GPU_COMPILER_OPTIONS: Mapping[str, Any] = types.MappingProxyType({
    'xla_gpu_enable_latency_hiding_scheduler': True,
})
