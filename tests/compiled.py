"""What the compiled-for-GPU test files share: skip where no GPU program can be compiled."""

import jax
import pytest

from dos_jax import dataflow


def skip_without_gpu_compiler() -> None:
  """Skips the calling module where the CUDA plugin is missing or a GPU is present (a
  GPU machine compiles for its own GPU elsewhere; deviceless compiles need
  `JAX_PLATFORMS=cpu`)."""
  available, why = dataflow.gpu_compiler_available()
  if not available:
    pytest.skip(f'no GPU compiler here: {why}', allow_module_level=True)
  if jax.default_backend() != 'cpu':
    pytest.skip('deviceless compiles run with JAX_PLATFORMS=cpu', allow_module_level=True)


def host_results_sent_back(program) -> set[str]:
  """The device->host copies (copy-start names) of a compiled program's host-call
  results: values a host call returned in device memory that go back to host memory
  (the early calls' state blocks, not gradients: `Schedule.gradient_copies` counts them,
  as they are computed from matrix multiplications)."""
  from dos_jax.dataflow import hlo  # pylint: disable=import-outside-toplevel
  entry = hlo.Module.parse(program.hlo_text).entry_computation
  by_name = entry.by_name()
  dones = {c.name.replace('call-start', 'call-done') for c in program.schedule.host_calls}
  found = set()
  for copy in program.schedule.copies:
    if not copy.to_host:
      continue
    source = by_name.get(by_name[copy.name].operands[0])
    while source is not None and source.opcode in ('get-tuple-element', 'bitcast'):
      source = by_name.get(source.operands[0])
    if source is not None and source.name in dones:
      found.add(copy.name)
  return found


def gradient_copies(program):
  """`program.schedule.gradient_copies()` less `host_results_sent_back`: the copies of
  weight gradients to host memory."""
  sent_back = host_results_sent_back(program)
  return tuple(c for c in program.schedule.gradient_copies() if c.name not in sent_back)


def compile_runner_step(cfg, devices=None, early=None):
  """The runner's step for `cfg` on `devices` (default: one) compiled for an H100 as
  `gpu_program.compile_step` compiles it, with the early host calls `early` moved in
  (`dos_jax.migrate(..., early=early)`): a tuple of sizes, or an int K for K host calls
  of near-equal size (`early_chunks.split`; 1: one host call); None: the ones the one
  builder chose."""
  import dos_jax  # pylint: disable=import-outside-toplevel
  from dos_jax.dataflow import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from dos_jax.train import gpu_program  # pylint: disable=import-outside-toplevel
  from dos_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  from dos_jax.step import early_chunks  # pylint: disable=import-outside-toplevel
  if early is None:
    return gpu_program.compile_step(cfg, 'h100_sxm', devices=devices)
  native = compile_lib.prepare('h100_sxm')
  program = gpu_program.build_step(cfg, devices)
  part = program.offloaded_state.partition
  if isinstance(early, int):
    early = tuple(len(p) for p in early_chunks.split(part.host, early)[:-1])
  opt_state = dos_jax.migrate(program.opt_state, part.plan, early=tuple(early))
  lowered = dataflow.lower_for_gpu(
      program.step, program.params, opt_state, program.tokens,
      target=dataflow.GpuTarget.parse('h100_sxm'), kwargs={'plan': None})
  return compile_lib.compile_lowered(lowered, 'h100_sxm', step_lib.compiler_options_for('gpu'),
                                     native_host_kernel=native)
