"""The XLA options dos_jax's GPU programs are compiled with.

`GPU_COMPILER_OPTIONS` turns on XLA's latency-hiding scheduler, which places each
asynchronous copy and host call by a cost model: gradient copies to host memory run
while the backward pass goes on, and the device update runs while the host call
computes. XLA's default GPU schedule issues every copy's done right after its start and
runs the host call and the device update one after the other (the schedules compiled
for an H100 are in experiments/RESULTS.md; tests/test_compiled_gpu.py checks them).

The runner compiles its steps with these on a GPU. A library user jits with `jit`:

    step = dos_jax.jit(step, donate_argnums=(0, 1))

which is `jax.jit` with these options on a GPU and tells the step being traced their
limit on asynchronous calls in flight (a plain `jax.jit`'s options are not visible
while it traces: there, trace inside `compiled_with(options)`, or set the limit in
`XLA_FLAGS`).

They are XLA:GPU options: the CPU backend rejects them, so pass them only on a GPU.

The step compiles under any of XLA's options; what overlaps depends on them
(tests/test_compiled_options.py, compiled for an H100):

* `GPU_COMPILER_OPTIONS`, the traced step told their limit (`jit`, the runner):
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

import contextlib
import contextvars
import functools
import os
import re
from typing import Any, Callable, Iterator, Mapping
import types

PARALLEL_ASYNC_COMPUTE_LIMIT = 3
LIMIT_OPTION = 'xla_gpu_experimental_parallel_async_compute_limit'
XLA_ASYNC_COMPUTE_LIMIT = 2  # XLA's default for LIMIT_OPTION
_LIMIT_FLAG = re.compile(rf'--{LIMIT_OPTION}=(\S*)')
# The limit of the options the step being traced will be compiled with, where dos_jax
# does the jitting (`jit`, `dataflow.compile_for_gpu`): None elsewhere.
_compiled_with: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    'dos_jax_async_compute_limit', default=None)
SCHEDULER_OPTION = 'xla_gpu_enable_latency_hiding_scheduler'
# Whether the options an enclosing `compiled_with` names turn the scheduler on (None
# outside one: the options are not known while the step traces).
_scheduler_told: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    'dos_jax_scheduler_on', default=None)
_SCHEDULER_FLAG = re.compile(rf'--{SCHEDULER_OPTION}(?:=(\S*))?')
_warned: set[str] = set()  # the once-per-process warnings given

GPU_COMPILER_OPTIONS: Mapping[str, Any] = types.MappingProxyType({
    'xla_gpu_enable_latency_hiding_scheduler': True,
    # The host call and the device tiers' two stream lanes are asynchronous calls in
    # flight together (`dos_jax.step.lanes`): 3 lets the scheduler run both lanes
    # beside the host call (XLA's default, 2, runs one); 4 moves two gradient copies
    # of the runner's AllHost step after the backward pass.
    LIMIT_OPTION: PARALLEL_ASYNC_COMPUTE_LIMIT,
})


def for_platform(platform: str) -> Mapping[str, Any] | None:
  """The options dos_jax compiles its steps with on `platform` (a JAX platform name):
  `GPU_COMPILER_OPTIONS` on a GPU, else none (the CPU backend rejects XLA:GPU options).

  >>> for_platform('cpu') is None
  True
  """
  return GPU_COMPILER_OPTIONS if platform in ('gpu', 'cuda', 'rocm') else None


def xla_flags_async_compute_limit(flags: str | None = None) -> int | None:
  """The limit on asynchronous calls in flight that XLA flags `flags` (None: the
  `XLA_FLAGS` environment variable) set, the last occurrence as XLA reads them; None
  where they set none.

  >>> xla_flags_async_compute_limit('--xla_gpu_experimental_parallel_async_compute_limit=3')
  3
  >>> xla_flags_async_compute_limit('--xla_force_host_platform_device_count=8') is None
  True
  """
  flags = os.environ.get('XLA_FLAGS', '') if flags is None else flags
  found = _LIMIT_FLAG.findall(flags)
  if not found:
    return None
  try:
    return max(int(found[-1]), 1)
  except ValueError:
    raise ValueError(f'XLA_FLAGS: --{LIMIT_OPTION} must be an integer, got '
                     f'{found[-1]!r}') from None


def async_compute_limit() -> int:
  """The limit on asynchronous calls in flight of the program the step being traced is
  compiled into: that of the options `jit` (or `dataflow.compile_for_gpu`, or an
  enclosing `compiled_with`) compiles the traced step with; else the one `XLA_FLAGS`
  sets; else XLA's default, 2. A plain `jax.jit`'s options are not visible while it
  traces, hence `compiled_with`.

  >>> with compiled_with(GPU_COMPILER_OPTIONS):
  ...   async_compute_limit()
  3
  >>> with compiled_with({LIMIT_OPTION: 4}):
  ...   async_compute_limit()
  4
  """
  for found in (_compiled_with.get(), xla_flags_async_compute_limit()):
    if found is not None:
      return found
  return XLA_ASYNC_COMPUTE_LIMIT


@contextlib.contextmanager
def compiled_with(options: Mapping[str, Any] | None) -> Iterator[None]:
  """Context: the steps traced inside will be compiled with XLA `options`: their limit
  on asynchronous calls in flight (the options', else `XLA_FLAGS`', else XLA's
  default) is what `async_compute_limit` and `compiled_limit` give there."""
  limit = (options or {}).get(LIMIT_OPTION)
  if limit is None:
    limit = xla_flags_async_compute_limit() or XLA_ASYNC_COMPUTE_LIMIT
  token = _compiled_with.set(int(limit))
  told = _scheduler_told.set(bool((options or {}).get(SCHEDULER_OPTION)) or
                             scheduler_in_xla_flags())
  try:
    yield
  finally:
    _compiled_with.reset(token)
    _scheduler_told.reset(told)


def compiled_limit() -> int | None:
  """The limit on asynchronous calls in flight of the options an enclosing
  `compiled_with` names, or None outside one.

  >>> with compiled_with({}):
  ...   compiled_limit()
  2
  """
  return _compiled_with.get()


def jit(fun: Callable[..., Any], *, compiler_options: Mapping[str, Any] | None = None,
        **jit_kwargs) -> Any:
  """`jax.jit(fun, **jit_kwargs)` compiled on a GPU with `GPU_COMPILER_OPTIONS` (and
  `compiler_options` over them; elsewhere with `compiler_options` alone), with dos_jax's
  transforms traced inside told the options' limit on asynchronous calls in flight, so
  that both stream lanes run beside the host call by construction.

  >>> import jax.numpy as jnp, dos_jax
  >>> step = dos_jax.jit(lambda x: x * 2)
  >>> step(jnp.ones(2)).tolist()
  [2.0, 2.0]
  """
  import jax  # pylint: disable=import-outside-toplevel
  options = {**(for_platform(jax.default_backend()) or {}), **(compiler_options or {})}

  @functools.wraps(fun)
  def traced(*args, **kwargs):
    with compiled_with(options):
      return fun(*args, **kwargs)

  return jax.jit(traced, compiler_options=options or None, **jit_kwargs)


def scheduler_in_xla_flags(flags: str | None = None) -> bool:
  """Whether `flags` (default: `XLA_FLAGS`) turn on XLA's latency-hiding scheduler.

  >>> scheduler_in_xla_flags('--xla_gpu_enable_latency_hiding_scheduler=true')
  True
  >>> scheduler_in_xla_flags('--xla_gpu_enable_latency_hiding_scheduler=false')
  False
  """
  flags = os.environ.get('XLA_FLAGS', '') if flags is None else flags
  found = _SCHEDULER_FLAG.findall(flags)
  return bool(found) and found[-1].lower() in ('', 'true', '1')


def warn_where_serial(version: str, checked: bool) -> None:
  """Once per process, one line each: where the step being traced for a GPU has no word
  that XLA's latency-hiding scheduler will be on (no `jit`, no `compiled_with`, not in
  `XLA_FLAGS`), and where jax `version`'s schedule of the construction was not
  `checked` by the compiled tests."""
  import warnings  # pylint: disable=import-outside-toplevel
  told = _scheduler_told.get()
  if told is None and not scheduler_in_xla_flags() and 'scheduler' not in _warned:
    _warned.add('scheduler')
    warnings.warn(
        f'dos_jax: this step is traced for a GPU with no word that XLA\'s latency-hiding '
        f'scheduler is on: without it the host update, the device update and the gradient '
        f'copies run one after the other; jit the step with dos_jax.jit, or set '
        f'--{SCHEDULER_OPTION}=true in XLA_FLAGS', stacklevel=4)
  if not checked and 'version' not in _warned:
    _warned.add('version')
    warnings.warn(
        f'dos_jax: jax {version} is newer than the versions whose compiled GPU schedule of '
        f'the step was checked (0.10-0.12): the step is built as for 0.12, and that the '
        f'device updates run inside a host call\'s window is not known', stacklevel=4)


def warn_rows_beside_no_host_work(rows: int, host_regions: int, per_lane: int) -> None:
  """Once per process, one line: the staged lowering (jax 0.12) has `rows` streamed
  rows left after its last stage, beside no host work, because the step has
  `host_regions` host regions for `per_lane` streamed rows per lane (one row per lane and
  a host region per stage: `dos_jax.step.stages`)."""
  import warnings  # pylint: disable=import-outside-toplevel
  if 'surplus rows' in _warned:
    return
  _warned.add('surplus rows')
  warnings.warn(
      f'dos_jax: {rows} streamed rows run after the last host call, beside no host work: '
      f'the step has {host_regions} host regions (after its early calls) for {per_lane} '
      f'streamed rows per lane, and on this jax each stage runs one row per lane beside a '
      f'host region of its own; the native host kernel (Implementation(host=KERNEL)), '
      f'fewer streamed subgroups (a larger Stride k, a smaller DeviceFraction) or more '
      f'host subgroups (a smaller offload.subgroup_size) put every row beside host work',
      stacklevel=4)
