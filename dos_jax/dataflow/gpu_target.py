"""The GPU a program is built for when no GPU is present: targets and lowering context.

A `GpuTarget` names one of XLA's GPU target configs (`GpuTargetConfigProto` text, kept
in `targets/`, see its README for where each file comes from). The CUDA PJRT plugin
builds a compile-only client from one, with no driver and no GPU (`compile.py`).

`lowering_device` is the context JAX >= 0.11 needs to lower Pallas kernels for a GPU
on a machine without one: an abstract GPU device of the target's kind. JAX 0.10 lowers
without it; a machine with a GPU uses its own.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
from typing import Any, Callable, Iterator


class GpuTarget(enum.Enum):
  """A GPU to compile for; the value is the target config's file name in `targets/`."""

  H100_SXM = 'h100_sxm'
  H200 = 'h200'

  @property
  def config_path(self) -> str:
    return os.path.join(os.path.dirname(__file__), 'targets', f'{self.value}.txtpb')

  def config_text(self) -> str:
    """The `GpuTargetConfigProto` text the plugin's compile-only client is built from."""
    with open(self.config_path, encoding='utf-8') as f:
      return f.read()

  @property
  def device_kind(self) -> str:
    """The device kind JAX reports for this GPU (the config's `device_description_str`)."""
    return _config_field(self, 'device_description_str')

  @property
  def core_count(self) -> int:
    return int(_config_field(self, 'core_count'))

  @classmethod
  def parse(cls, value: 'GpuTarget | str') -> 'GpuTarget':
    """A target from its name ('h100_sxm', 'h100', 'h200'); one-line error otherwise."""
    if isinstance(value, cls):
      return value
    name = str(value).lower()
    aliases = {'h100': cls.H100_SXM}
    if name in aliases:
      return aliases[name]
    try:
      return cls(name)
    except ValueError:
      known = ', '.join(t.value for t in cls)
      raise ValueError(f'unknown GPU target {value!r} (known: {known})') from None


DEFAULT_TARGET = GpuTarget.H100_SXM


@functools.cache
def _config_field(target: GpuTarget, field: str) -> str:
  for line in target.config_text().splitlines():
    key, _, value = line.strip().partition(':')
    if key == field:
      return value.strip().strip('"')
  raise KeyError(f'{target.config_path} has no {field}')


def _has_gpu() -> bool:
  import jax  # pylint: disable=import-outside-toplevel
  try:
    return bool(jax.devices('gpu'))
  except RuntimeError:
    return False


@contextlib.contextmanager
def lowering_device(target: GpuTarget | str | None = None) -> Iterator[None]:
  """Lowers inside with an abstract GPU device of `target` in context, where needed.

  JAX >= 0.11 asks for one to lower a Pallas kernel for a GPU when no GPU is present
  ("please specify an abstract GPU device using AbstractDevice"). It is found through
  `jax._src.mesh` (no public spelling yet): where that is missing, or a GPU is
  present, the lowering runs as it is. Keeps the axes of an abstract mesh already in
  context (a sharded program's).
  """
  import jax  # pylint: disable=import-outside-toplevel
  from dos_jax.kernels import jax_internals  # pylint: disable=import-outside-toplevel
  abstract_device_type = jax_internals.abstract_device_type()
  if abstract_device_type is None or _has_gpu():
    yield
    return
  target = GpuTarget.parse(target or DEFAULT_TARGET)
  device = abstract_device_type(device_kind=target.device_kind, num_cores=target.core_count,
                                platform='gpu')
  current = jax.sharding.get_abstract_mesh()
  sizes = tuple(getattr(current, 'axis_sizes', ()) or ())
  names = tuple(getattr(current, 'axis_names', ()) or ())
  types = tuple(getattr(current, 'axis_types', ()) or ()) or None
  mesh: Any = jax.sharding.AbstractMesh(sizes, names, axis_types=types, abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def lower_for_gpu(fn: Callable[..., Any], *args, target: Any = None,
                  kwargs: dict[str, Any] | None = None, **jit_kwargs) -> Any:
  """`jax.jit(fn, **jit_kwargs)` traced on `args` (and keyword `kwargs`) and lowered
  for CUDA; `fn` may already be jitted (then `jit_kwargs` must be empty).

  Works on a machine without a GPU (Pallas Triton / Mosaic GPU kernels included),
  which is the point: the GPU program's structure can be checked anywhere. Where no
  GPU is present the lowering runs with an abstract GPU device of `target` (a
  `GpuTarget`, default the H100) in context, which jax >= 0.11 needs to lower Pallas
  kernels for a GPU (see `gpu_target.lowering_device`).
  """
  import jax  # pylint: disable=import-outside-toplevel
  jitted = fn if hasattr(fn, 'trace') and not jit_kwargs else jax.jit(fn, **jit_kwargs)
  with lowering_device(target):
    return jitted.trace(*args, **(kwargs or {})).lower(lowering_platforms=('cuda',))
