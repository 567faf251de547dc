"""Builds the native host AdamW libraries of dos_jax.kernels (kernels/host_adamw_rows.cc,
the state in memory; kernels/host_adamw_disk.cc, the state in files; kernels/host_adamw8.cc, 8-bit moments), and the probe of
the instruction sets their loop can use here (kernels/host_isa.cc).

Everything else about the package lives in pyproject.toml. The XLA FFI headers come from
the jaxlib installed in the build environment (a build requirement), located without
importing it. The extensions are optional: where one cannot be compiled the package still
installs and `dos_jax.kernels.rows_kernel_available()` (or
`host_adamw_disk.disk_kernel_available()`) says why it is missing.

Which headers, and why. A handler reports the XLA FFI API version of the headers it was
compiled with, and an XLA runtime accepts only versions it knows: jaxlib 0.10.2 accepts
0.1-0.3, jaxlib 0.11.2 and its CUDA plugin 0.1-0.4, the 0.12 headers are 0.5. Built
against newer headers than the runtime's, the kernels are refused: by jaxlib's CPU
registry (an error), and silently by a CUDA plugin (its PJRT FFI extension ignores the
registry's answer). So an isolated build (`pip install .`, `pip install -e .`) uses the
headers of the OLDEST supported jaxlib, pinned in pyproject's build requirements
(`jaxlib==0.10.2`, FFI API 0.3), whose handlers every supported jaxlib and plugin
accepts; not the newest (what an unpinned requirement gets), nor the installed jaxlib
(a build against it would have to be redone whenever jaxlib changes, and a GPU machine's
plugin may be older than the jaxlib beside it). `python setup.py build_ext --inplace`
uses the environment's jaxlib instead. Either way the version is recorded: in the
library (`ffi_api_version()`), in the build stamp (kernels/<lib>.so.sha256) and in the
build's output; and at run time, before the kernel is used inside GPU programs, a
probe compile proves the plugin took it (kernels/_pjrt.py).
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir() -> str:
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError('building dos_jax needs jaxlib for the XLA FFI headers')
  return os.path.join(list(spec.submodule_search_locations)[0], 'include')


def _ffi_api_version() -> str:
  """'major.minor' of the XLA FFI headers compiled against (their c_api.h), or '?'."""
  path = os.path.join(_ffi_include_dir(), 'xla', 'ffi', 'api', 'c_api.h')
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except OSError:
    return '?'
  found = [re.search(rf'#define XLA_FFI_API_{part}\s+(\d+)', text) for part in ('MAJOR', 'MINOR')]
  return '.'.join(m.group(1) for m in found) if all(found) else '?'


def _build_jaxlib() -> str:
  """Version of the jaxlib whose headers the build uses."""
  try:
    return importlib.metadata.version('jaxlib')
  except importlib.metadata.PackageNotFoundError:
    return '?'


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
      depends=['kernels/adamw_loop.h', 'kernels/adamw_common.h', 'kernels/adamw_rows.h',
               'kernels/adamw8_loop.h', 'kernels/adamw8_avx512.h',
               'kernels/adamw_rows_setup.h', 'kernels/pjrt_register.h',
               'kernels/undo_store.h'],
      include_dirs=[_ffi_include_dir()],
      extra_compile_args=_compile_args(),
      extra_link_args=['-pthread'],
      language='c++',
      optional=True,
  )


def _digest(paths: list[str], extra: str = '', *, names: bool = True) -> str:
  h = hashlib.sha256(extra.encode())
  for path in paths:
    if names:
      h.update(path.encode())
    with open(path, 'rb') as f:
      h.update(f.read())
  return h.hexdigest()


def _input_digest(ext: Extension) -> str:
  """sha256 of everything a library is built from: its sources and headers, this file
  (flags), the XLA FFI headers of the jaxlib in the build environment, the compile
  arguments. Contents, not mtimes: an isolated build installs jaxlib afresh each time."""
  ffi_dir = os.path.join(_ffi_include_dir(), 'xla', 'ffi', 'api')
  headers = sorted(os.path.join(ffi_dir, n) for n in os.listdir(ffi_dir)) if os.path.isdir(
      ffi_dir) else []
  # Header contents only: their directory is a new temporary one in every isolated build.
  return _digest([*ext.sources, *ext.depends, os.path.basename(__file__)], extra=repr((
      ext.name, ext.extra_compile_args, ext.extra_link_args, _digest(headers, names=False))))


class CachedBuildExt(build_ext):
  """build_ext that reuses an up-to-date library instead of compiling it again.

  `pip install -e .` builds in a fresh temporary directory every time, so plain
  build_ext recompiled every library (~48 s) on every reinstall. After a build, a
  stamp next to the in-place library (kernels/<lib>.so.sha256, which an editable
  install also writes there) records the digest of its inputs and of the library; a
  later build whose inputs have the same digest copies that library instead. Any edit
  to a source, header, flag or the jaxlib headers rebuilds. The libraries compile in
  parallel, one per core (setuptools' `--parallel`, which a command line may still set).
  """

  def finalize_options(self):
    super().finalize_options()
    if not self.parallel:
      self.parallel = os.cpu_count() or 1

  def build_extension(self, ext):
    target = self.get_ext_fullpath(ext.name)
    package_dir = self.get_finalized_command('build_py').get_package_dir('dos_jax.kernels')
    cached = os.path.join(package_dir, os.path.basename(target))
    stamp = cached + '.sha256'
    inputs = _input_digest(ext)
    headers = {'ffi_api': _ffi_api_version(), 'jaxlib': _build_jaxlib()}
    try:
      with open(stamp, encoding='utf-8') as f:
        recorded = json.load(f)
      fresh = (not self.force and recorded.get('inputs') == inputs
               and _digest([cached], names=False) == recorded.get('library'))
    except (OSError, ValueError, AttributeError):
      fresh = False
    if fresh:
      if os.path.abspath(cached) != os.path.abspath(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(cached, target)
      print(f'{ext.name}: inputs unchanged, reusing {cached} (XLA FFI API '
            f'{recorded.get("ffi_api", "?")}, jaxlib {recorded.get("jaxlib", "?")} headers)')
      return
    print(f'{ext.name}: compiling against XLA FFI API {headers["ffi_api"]} '
          f'(jaxlib {headers["jaxlib"]} headers)')
    super().build_extension(ext)
    if os.path.exists(target) and os.path.isdir(package_dir):
      # Put the new library where the stamp points now, rather than leaving it to
      # setuptools' in-place copy, which runs later and skips by mtime.
      if os.path.abspath(cached) != os.path.abspath(target):
        shutil.copy2(target, cached)
      with open(stamp, 'w', encoding='utf-8') as f:
        json.dump({'inputs': inputs, 'library': _digest([cached], names=False), **headers}, f)


setup(
    cmdclass={'build_ext': CachedBuildExt},
    ext_modules=[
        # The loop over rows of the stacked state (the core's host path), and its
        # registration inside a GPU PJRT plugin, for GPU programs' host regions.
        _native_extension('_host_adamw_rows', 'host_adamw_rows.cc', 'pjrt_register.cc'),
        # The same loop over subgroups whose state is in files (the disk tier).
        _native_extension('_host_adamw_disk', 'host_adamw_disk.cc', 'pjrt_register.cc'),
        # AdamW with block-wise 8-bit moments (kernels/adamw8_reference.py's format).
        _native_extension('_host_adamw8', 'host_adamw8.cc'),
        # Which instruction sets that loop can use on this CPU (adamw_common.h's answer).
        _native_extension('_host_isa', 'host_isa.cc'),
    ],
)
