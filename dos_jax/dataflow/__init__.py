"""The GPU program seen without a GPU: lowered and compiled for a GPU target on any
machine, and read from the compiled program.

* `lower_for_gpu`, `compile_for_gpu`, `compile_lowered` (`gpu_target`, `compile`): a
  step lowered for CUDA and compiled by XLA:GPU's compiler for a `GpuTarget` (the
  topologies in targets/), where no GPU is present;
* `Schedule` (`schedule`, `hlo`, `streamed_rows`, `thunks`): the compiled program's
  order of asynchronous starts and dones, its host calls and streamed rows;
* `compile_step` (`early_windows`): the runner's one compile of a step, with its early
  host calls named from the lowered program;
* `kernel_probe`: the program that proves a GPU plugin took the native host kernel
  (run by `kernels._pjrt` as a child process).

The def-use graph of a lowered program, which the tests read, is `tests/tooling/graph.py`.
"""

from dos_jax.dataflow.compile import compile_for_gpu as compile_for_gpu
from dos_jax.dataflow.compile import compile_lowered as compile_lowered
from dos_jax.dataflow.compile import CompiledGpuProgram as CompiledGpuProgram
from dos_jax.dataflow.compile import gpu_compiler_available as gpu_compiler_available
from dos_jax.dataflow.compile import GpuCompilerUnavailable as GpuCompilerUnavailable
from dos_jax.dataflow.compile import MemoryStats as MemoryStats
from dos_jax.dataflow.early_windows import compile_step as compile_step
from dos_jax.dataflow.gpu_target import GpuTarget as GpuTarget
from dos_jax.dataflow.gpu_target import lower_for_gpu as lower_for_gpu
from dos_jax.dataflow.schedule import Schedule as Schedule
