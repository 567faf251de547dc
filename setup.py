"""Builds the native host AdamW libraries (kernels/host_adamw*.cc) of dos_jax.kernels.

Everything else about the package lives in pyproject.toml. The XLA FFI headers come from
the jaxlib installed in the build environment (a build requirement), located without
importing it. The extension is optional: where it cannot be compiled the package still
installs and `dos_jax.kernels.host_kernel_available()` says why it is missing.
"""

import importlib.util
import os

from setuptools import Extension, setup


def _ffi_include_dir() -> str:
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError('building dos_jax needs jaxlib for the XLA FFI headers')
  return os.path.join(list(spec.submodule_search_locations)[0], 'include')


def _compile_args() -> list[str]:
  args = [
      '-std=c++17', '-O3', '-fvisibility=hidden',
      # Bit-equality with XLA: no implicit FMA contraction (the kernel spells out the
      # FMAs XLA makes), no fast math. -fno-math-errno only lets sqrt be inlined and
      # vectorized; it does not change any result.
      '-ffp-contract=off', '-fno-math-errno',
  ]
  # No -march: the baseline stays what the compiler targets by default (SSE2 on x86-64),
  # so the library loads on any machine of the architecture; the AVX2 and AVX-512
  # versions of the loop are compiled with target attributes and picked at run time.
  return args


def _native_extension(name: str, *sources: str) -> Extension:
  """One native host AdamW library: optional, so a failed compile leaves XLA's path."""
  return Extension(
      f'dos_jax.kernels.{name}',
      sources=[f'kernels/{source}' for source in sources],
      depends=['kernels/adamw_loop.h', 'kernels/adamw_common.h'],
      include_dirs=[_ffi_include_dir()],
      extra_compile_args=_compile_args(),
      extra_link_args=['-pthread'],
      language='c++',
      optional=True,
  )


setup(
    ext_modules=[
        _native_extension('_host_adamw', 'host_adamw.cc'),
        # The same loop rules over rows of the stacked state (the core's host path), and
        # its registration inside a GPU PJRT plugin, for GPU programs' host regions.
        _native_extension('_host_adamw_rows', 'host_adamw_rows.cc', 'pjrt_register.cc'),
    ],
)
