"""The dataflow graph of a lowered program: what the GPU program does, seen on any machine.

A step lowered for the GPU on a machine without one (`lower_for_gpu`, i.e.
`jax.jit(step).trace(...).lower(lowering_platforms=('cuda',))`) is StableHLO whose
def-use graph shows what XLA may overlap: two ops with no path between them can run at
the same time, an op that (transitively) uses another's result cannot start before it.
`Graph` walks the entry function's (`@main`'s) top-level ops and attributes everything
nested in an op to that op: the ops in its regions (`stablehlo.while` bodies,
`stablehlo.case` branches) and, transitively, the ops of the functions it calls
(`func.call`; JAX outlines jitted and closed-over pieces into `func.func private`
functions, also from inside loop bodies). The tests use it to prove the shape of
dos_jax's GPU program without a GPU: the host region and the device stream are
independent, and host-bound gradients leave the device before the backward pass ends.

It reads the MLIR Python objects of `Lowered.compiler_ir('stablehlo')` (op names,
attributes, operands, results), never the printed module, and imports nothing private
from JAX. What each `OpKind` matches is in its docstring; the markers were read off
JAX 0.10's lowering:

* host region: `func.call @compute_on(...) {mhlo.frontend_attributes =
  {_xla_compute_type = "host"}}` (`compute_on2(f, compute_type='device_host', ...)`
  on JAX 0.10, `compute_on` on 0.11; JAX also stamps the attribute on every op inside
  the callee);
* transfer: `stablehlo.custom_call @annotate_device_placement(x)
  {mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host" | "device"}}`
  (`jax.device_put(x, jax.memory.Space.Host | Device)` inside jit). JAX also wraps every
  output of a host region in one, `"pinned_host"` for a host-resident output: an
  annotation of a value that is already there, which moves nothing (`Transfer.moves`);
* Pallas kernel: `stablehlo.custom_call @__gpu$xla.gpu.triton` (Triton; its
  `mhlo.backend_config` dictionary holds the kernel's `name`) or `@mosaic_gpu_v2`
  (Mosaic GPU; no name outside the serialized kernel).

`Graph.memory_space` tells where a top-level value lives, so that a placement of a value
already in that memory is not counted as a transfer.
"""

from dos_jax.dataflow.graph import Graph as Graph
from dos_jax.dataflow.graph import Node as Node
from dos_jax.dataflow.graph import Transfer as Transfer
from dos_jax.dataflow.graph import lower_for_gpu as lower_for_gpu
from dos_jax.dataflow.ops import Dot as Dot
from dos_jax.dataflow.ops import OpKind as OpKind
from dos_jax.dataflow.ops import TensorType as TensorType
from dos_jax.dataflow.compile import compile_for_gpu as compile_for_gpu
from dos_jax.dataflow.compile import compile_lowered as compile_lowered
from dos_jax.dataflow.compile import CompiledGpuProgram as CompiledGpuProgram
from dos_jax.dataflow.compile import gpu_compiler_available as gpu_compiler_available
from dos_jax.dataflow.compile import GpuCompilerUnavailable as GpuCompilerUnavailable
from dos_jax.dataflow.compile import MemoryStats as MemoryStats
from dos_jax.dataflow.early_windows import compile_step as compile_step
from dos_jax.dataflow.gpu_target import GpuTarget as GpuTarget
from dos_jax.dataflow.schedule import Schedule as Schedule
