"""The child process that proves the native host kernel inside the CUDA plugin.

`kernels._pjrt.run_probe` runs `main` in a process of its own: it builds the plugin's
compile-only client (`compile._topology`, no GPU needed), registers the native
library's handlers there as the parent did, and compiles a tiny GPU program whose host
region calls every target. A handler the plugin dropped aborts this process inside the
plugin's compiler, which the parent reads from the exit status and stderr; otherwise
the verdict is one line on stdout (`_pjrt.verdict_line`).

It lives here, beside the compile-only client it uses, so that the kernels import
nothing of the dataflow layer: the parent names this module on a command line only.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Mapping

import jax

from dos_jax import memory_spaces
from dos_jax.dataflow import compile as compile_lib
from dos_jax.kernels import _pjrt


def _compute_on_function() -> Any:
  """The function form of `compute_on` (see `memory_spaces.compute_on_function`)."""
  fn = memory_spaces.compute_on_function()
  if fn is None:
    raise RuntimeError('no function form of compute_on in this jax')
  return fn


def probe_program(targets: Mapping[str, str]) -> Any:
  """A program lowered for CUDA whose host region calls every target once (the
  operands need not fit the handlers: the program is compiled, never run)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def body(x):
    outs = [jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
            for name in targets]
    return sum(outs[1:], outs[0])

  region = _compute_on_function()(body, compute_type='device_host',
                                  out_memory_spaces=jax.memory.Space.Host)
  pinned = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0], memory_kind='pinned_host')
  x = jax.device_put(jnp.ones((8,), jnp.float32), pinned)
  return jax.jit(region).trace(x).lower(lowering_platforms=('cuda',))


def main(spec_json: str) -> None:
  """The child (run by `_pjrt.run_probe`): register, then compile; print the verdict
  and exit (0 when the plugin took every handler)."""
  ok, why = False, ''
  try:
    spec = json.loads(spec_json)
    targets = dict(spec['targets'])
    compile_lib._topology(compile_lib.gpu_target.DEFAULT_TARGET)  # pylint: disable=protected-access
    api, why = _pjrt.plugin_c_api('cuda')
    if api is not None:
      native = importlib.import_module(spec['module'])
      why = _pjrt.register(native, targets, 'cuda', api)
      if not why:
        compile_lib.compile_lowered(probe_program(targets), compiler_options={})
        ok = True
  except Exception as e:  # pylint: disable=broad-except
    ok, why = False, f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
  print(_pjrt.verdict_line(ok, why), flush=True)
  sys.stdout.flush()
  os._exit(0 if ok else 1)  # pylint: disable=protected-access  # skip JAX's teardown
