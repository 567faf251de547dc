"""Compiling a program for a GPU on a machine without one (deviceless AOT).

The CUDA PJRT plugin (`pip install "jax[cuda13]"`) builds a compile-only client from an
XLA GPU target config (`GpuTarget`), no driver needed. `compile_for_gpu` lowers a
function as the dataflow tests do (the arguments' real memory kinds, pinned-host state
included, `lowering_platforms=('cuda',)`) and compiles that StableHLO with the plugin's
XLA for the target. The result is the optimized, *scheduled* HLO a GPU would run: what
overlaps, what is copied, what is in place (`schedule.Schedule`), and the program's
memory (`compiled_memory_stats`).

JAX's own AOT path on a topology's devices cannot be used for this: it drops memory
kinds, so a pinned-host state cannot be expressed there. Hence the lower-then-compile
route, which uses two of JAX's internals (`jax._src.compiler.get_compile_options`, the
topology client's `compile`), guarded: where they are missing the error says so.

The program's host regions are compiled by the plugin's own XLA, whose FFI registry is
not jaxlib's: the native host AdamW is registered there first
(`kernels.host_adamw_rows.register_for_gpu_compile`), or the program falls back to
XLA's host loop, as it would on a GPU where the kernel cannot be registered.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import tempfile
import time
from typing import Any, Callable, Mapping

from dos_jax import compiler_options as compiler_options_lib
from dos_jax.compiler_options import GPU_COMPILER_OPTIONS
from dos_jax.dataflow import early_windows as early_windows_lib
from dos_jax.dataflow import gpu_target
from dos_jax.dataflow.gpu_target import GpuTarget
from dos_jax.dataflow.gpu_target import lower_for_gpu
from dos_jax.dataflow.schedule import Schedule
from dos_jax.dataflow.thunks import ThunkProgram


class GpuCompilerUnavailable(RuntimeError):
  """No CUDA PJRT plugin (or no compatible one) to compile GPU programs with."""


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Bytes of a compiled program (XLA's `CompiledMemoryStats`), device and host."""

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  host_argument_bytes: int
  host_output_bytes: int
  host_alias_bytes: int
  host_temp_bytes: int

  @classmethod
  def from_xla(cls, stats: Any) -> 'MemoryStats':
    get = lambda name: int(getattr(stats, name, 0) or 0)
    return cls(
        argument_bytes=get('argument_size_in_bytes'), output_bytes=get('output_size_in_bytes'),
        alias_bytes=get('alias_size_in_bytes'), temp_bytes=get('temp_size_in_bytes'),
        host_argument_bytes=get('host_argument_size_in_bytes'),
        host_output_bytes=get('host_output_size_in_bytes'),
        host_alias_bytes=get('host_alias_size_in_bytes'),
        host_temp_bytes=get('host_temp_size_in_bytes'))

  @property
  def device_peak_bytes(self) -> int:
    """Arguments, temporaries and the outputs that do not reuse an argument's buffer."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class CompiledGpuProgram:
  """A program compiled for a GPU target: its scheduled HLO, memory and compile time."""

  target: GpuTarget
  hlo_text: str
  memory: MemoryStats
  compile_s: float  # every compile it took (`compiles`)
  compiler_options: Mapping[str, Any]
  native_host_kernel: bool  # the native host AdamW was registered for host regions
  thunks: ThunkProgram | None = None  # what the GPU runs (compiled with `thunks=True`)
  # The early host calls given a profiled latency (`dos_jax.dataflow.early_windows`).
  early_calls_profiled: tuple[str, ...] = ()
  # How many compiles it took: 2 where XLA did not name the early calls as predicted.
  compiles: int = 1

  @functools.cached_property
  def schedule(self) -> Schedule:
    return Schedule.from_text(self.hlo_text)

  def transfers_one_after_another(self) -> list[tuple[str, str]]:
    """(a streamed row's write-back, the next row's fetch) pairs that run on one CUDA
    stream, one after the other: the link carries one direction at a time there,
    whatever the schedule's dependencies allow. Needs `thunks`."""
    if self.thunks is None:
      raise ValueError('compile with thunks=True to see what runs on which stream')
    rows = self.schedule.streamed_rows
    return [(a.write_back, b.fetch) for a, b in zip(rows, rows[1:])
            if a.stream == b.stream and a.write_back is not None
            and self.thunks.one_after_another(a.write_back, b.fetch)]


def gpu_compiler_available() -> tuple[bool, str]:
  """Whether GPU programs can be compiled here: `(True, '')` or `(False, why)`."""
  try:
    _topology(GpuTarget.H100_SXM)
  except GpuCompilerUnavailable as e:
    return False, str(e)
  return True, ''


def cudnn_compiles_here() -> tuple[bool, str]:
  """(whether the CUDA plugin compiles cuDNN fusions, such as cuDNN's attention, on this
  machine without a GPU; why not). The jax 0.12.1 plugin compiles them with cuDNN's
  runtime-compiled engines, which load only where a GPU driver (libcuda.so.1) does;
  0.11.2 and 0.12.0.1 compile them without one."""
  import jax  # pylint: disable=import-outside-toplevel
  if tuple(jax.__version_info__[:3]) < (0, 12, 1):
    return True, ''
  try:
    ctypes.CDLL('libcuda.so.1')
  except OSError:
    return False, (f'the jax {jax.__version__} CUDA plugin compiles cuDNN fusions (cuDNN '
                   'attention) only where a GPU driver (libcuda.so.1) loads')
  return True, ''


def _cuda_plugin_present() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec('jax_plugins') is None:
    return False
  return any(importlib.util.find_spec(f'jax_plugins.{name}') is not None
             for name in ('xla_cuda13', 'xla_cuda12'))


@functools.cache
def _topology(target: GpuTarget, num_devices: int = 1) -> Any:
  """The plugin's compile-only topology for `target`: `num_devices` GPUs on one host."""
  import jax  # pylint: disable=import-outside-toplevel
  if not _cuda_plugin_present():
    raise GpuCompilerUnavailable(
        f'no CUDA PJRT plugin installed (pip install "jax[cuda13]=={jax.__version__}")')
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    return topologies.get_topology_desc(
        topology_name=target.value, platform='cuda', topology=f'1x1x{num_devices}',
        target_config=target.config_text())
  except Exception as e:  # pylint: disable=broad-except
    raise GpuCompilerUnavailable(
        f'the CUDA plugin could not build a {target.value} topology: '
        f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}') from e


def _compile_options(devices: tuple[Any, ...], options: Mapping[str, Any]) -> Any:
  from dos_jax.kernels import jax_internals  # pylint: disable=import-outside-toplevel
  options = dict(options)
  fdo_profile = options.pop('fdo_profile', None)  # as jax's own compile takes it
  # One SPMD partition per device (JAX's default partitioner for a sharded program).
  return jax_internals.compile_options(
      num_replicas=1, num_partitions=len(devices), device_assignment=[list(devices)],
      env_options_overrides=options, fdo_profile=fdo_profile)


def _num_partitions(module: Any) -> int:
  """The SPMD partitions a lowered module was made for (`mhlo.num_partitions`; 1 for
  a program on one device)."""
  attributes = module.operation.attributes
  if 'mhlo.num_partitions' not in attributes:
    return 1
  return int(str(attributes['mhlo.num_partitions']).split(':')[0])


def compile_lowered(lowered: Any, target: GpuTarget | str = gpu_target.DEFAULT_TARGET,
                    compiler_options: Mapping[str, Any] | None = None,
                    native_host_kernel: bool = False,
                    thunks: bool = False, early_windows: bool = True) -> CompiledGpuProgram:
  """Compiles a `jax.stages.Lowered` (lowered for 'cuda') for `target`.

  A program lowered for several devices (a mesh) is compiled for as many GPUs of
  `target` on one host, one SPMD partition each; `hlo_text` and `memory` are then one
  partition's.

  Args:
    lowered: e.g. `dataflow.lower_for_gpu(step, *args)`.
    target: the GPU to compile for.
    compiler_options: XLA options; default `GPU_COMPILER_OPTIONS`.
    native_host_kernel: recorded in the result (whether the program was built with the
      native host kernel registered in the plugin).
    thunks: also read what the GPU would run, thunk by thunk (`dataflow.thunks`), from
      an XLA dump in a temporary directory.
    early_windows: give the program's early host calls a profiled latency, as
      `dataflow.compile_step` does (`dataflow.early_windows`: a second compile where XLA
      did not name them as predicted).
  """
  import jax  # pylint: disable=import-outside-toplevel
  target = GpuTarget.parse(target)
  options = dict(GPU_COMPILER_OPTIONS if compiler_options is None else compiler_options)
  module = lowered.compiler_ir('stablehlo')
  devices = tuple(_topology(target, _num_partitions(module)).devices)
  from dos_jax.kernels import jax_internals  # pylint: disable=import-outside-toplevel
  device_list = jax_internals.device_list(devices)

  def compile_once(extra):
    dump_dir = tempfile.TemporaryDirectory(prefix='dos_jax_thunks_') if thunks \
        else contextlib.nullcontext()
    with dump_dir as dump:
      compile_options = dict(options, **extra)
      if thunks:
        compile_options['xla_dump_to'] = dump
      start = time.perf_counter()
      executable = devices[0].client.compile(
          module, executable_devices=device_list,
          compile_options=_compile_options(devices, compile_options))
      compile_s = time.perf_counter() - start
      hlo_module = executable.hlo_modules()[0]
      program = ThunkProgram.from_dump(dump, module=f'.{hlo_module.name}.') if thunks else None
    return executable, hlo_module.to_string(), compile_s, program

  if early_windows:
    compiles = []

    def counted(extra):
      compiles.append(compile_once(extra))
      return compiles[-1]

    (executable, hlo_text, _, program), profiled, count = early_windows_lib.compile_profiled(
        counted, lambda result: result[1],
        early_windows_lib.predicted_early_calls(lowered.as_text()))
    compile_s = sum(c[2] for c in compiles)
  else:
    (executable, hlo_text, compile_s, program), profiled, count = compile_once({}), (), 1
  return CompiledGpuProgram(
      target=target, hlo_text=hlo_text,
      memory=MemoryStats.from_xla(executable.get_compiled_memory_stats()),
      compile_s=compile_s, compiler_options=options,
      native_host_kernel=native_host_kernel, thunks=program, early_calls_profiled=profiled,
      compiles=count)


def prepare(target: GpuTarget | str = gpu_target.DEFAULT_TARGET) -> bool:
  """Sets up compiling for `target` before a program is traced: builds the plugin's
  topology and registers the native host kernel there. Returns whether the kernel is
  usable in the program's host regions (else they take XLA's host loop)."""
  _topology(GpuTarget.parse(target))
  from dos_jax.kernels import host_adamw_disk  # pylint: disable=import-outside-toplevel
  from dos_jax.kernels import host_adamw_rows  # pylint: disable=import-outside-toplevel
  host_adamw_disk.register_for_gpu_compile()  # its verdict: the disk tier's check reads it
  return host_adamw_rows.register_for_gpu_compile()[0]


def compile_for_gpu(fn: Callable[..., Any], *args,
                    target: GpuTarget | str = gpu_target.DEFAULT_TARGET,
                    compiler_options: Mapping[str, Any] | None = None,
                    thunks: bool = False, early_windows: bool = True,
                    **jit_kwargs) -> CompiledGpuProgram:
  """`jax.jit(fn, **jit_kwargs)` on `args`, compiled for a GPU target, with no GPU.

  Build `fn`'s dos_jax transforms with `Implementation(program='gpu')` (the accelerator
  program). Run with `JAX_PLATFORMS=cpu` where there is no GPU (else the plugin's
  start-up looks for one). Raises `GpuCompilerUnavailable` where no CUDA plugin is
  installed.
  """
  native = prepare(target)
  options = GPU_COMPILER_OPTIONS if compiler_options is None else compiler_options
  with compiler_options_lib.compiled_with(options):  # the traced step knows its limit
    lowered = lower_for_gpu(fn, *args, target=GpuTarget.parse(target), **jit_kwargs)
  return compile_lowered(lowered, target, options, native_host_kernel=native,
                         thunks=thunks, early_windows=early_windows)
