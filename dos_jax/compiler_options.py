"""The XLA options dos_jax's GPU programs are compiled with.

`GPU_COMPILER_OPTIONS` turns on XLA's latency-hiding scheduler, which places each
asynchronous copy and host call by a cost model: gradient copies to host memory run
while the backward pass goes on, and the device update runs while the host call
computes. XLA's default GPU schedule issues every copy's done right after its start and
runs the host call and the device update one after the other (the schedules compiled
for an H100 are in experiments/RESULTS.md; tests/test_compiled_gpu.py checks them).

The runner compiles its steps with these on a GPU. A library user passes them to jit:

    step = jax.jit(step, donate_argnums=(0, 1), compiler_options=dos_jax.GPU_COMPILER_OPTIONS)

and tells the optimizer the options' limit on asynchronous calls in flight (a jitted
step's options are not visible while it is traced):
`dos_jax.Offload(..., async_compute_limit=dos_jax.PARALLEL_ASYNC_COMPUTE_LIMIT)`.

They are XLA:GPU options: the CPU backend rejects them, so pass them only on a GPU.

The step compiles under any of XLA's options; what overlaps depends on them
(tests/test_compiled_options.py, compiled for an H100):

* `GPU_COMPILER_OPTIONS`, with the optimizer told their limit
  (`Offload(async_compute_limit=PARALLEL_ASYNC_COMPUTE_LIMIT)`, as the runner's is):
  both stream lanes run beside the last host call in every schedule and the stream is
  full duplex (no streamed row's fetch waits for a write-back).
* The latency-hiding scheduler alone (`xla_gpu_enable_latency_hiding_scheduler`): the
  first stream lane runs beside the last host call in every schedule, the second one
  where the scheduler finds room, since XLA lets only 2 asynchronous calls (host call,
  stream lanes) be in flight unless `xla_gpu_experimental_parallel_async_compute_limit`
  says more. An optimizer told a limit above the one compiled with stops the compile
  inside XLA (a scheduling group it cannot place).
* XLA's defaults: no latency-hiding scheduler, so nothing overlaps: the device update
  runs after the host calls.
"""

from typing import Any, Mapping
import types

PARALLEL_ASYNC_COMPUTE_LIMIT = 3

GPU_COMPILER_OPTIONS: Mapping[str, Any] = types.MappingProxyType({
    'xla_gpu_enable_latency_hiding_scheduler': True,
    # The host call and the device tiers' two stream lanes are asynchronous calls in
    # flight together (`dos_jax.step.lanes`): 3 lets the scheduler run both lanes
    # beside the host call (XLA's default, 2, runs one); 4 moves two gradient copies
    # of the runner's AllHost step after the backward pass.
    'xla_gpu_experimental_parallel_async_compute_limit': PARALLEL_ASYNC_COMPUTE_LIMIT,
})
