"""How deep the step's kernel calls sit: from `alias.adamw`'s `update`
(`dos_jax.step.transform`'s `update_fn`) to the frame that calls a kernel, the device side
(the Pallas AdamW of a streamed row) in at most 8 frames of at most 5 modules, the host
side (the native host AdamW of an early host call, of the last one, of a redo) in at
most 6 of at most 4. Counted on the stacks the trace of one two-memory step runs the
kernel call sites on (the kernels' own frames and JAX's left out), with and without
the clip factor that makes early calls speculate."""

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

import dos_jax
from dos_jax.kernels import host_adamw_rows
from dos_jax.kernels import pallas_adamw

ROOT = os.path.dirname(dos_jax.__file__)  # dos_jax.kernels lives outside it (kernels/)
LIMITS = {'device': (8, 5), 'host': (6, 4)}


def _stacks(monkeypatch, clip: bool) -> dict[str, set[tuple[tuple[str, str], ...]]]:
  """{'device' | 'host': the distinct stacks (module, function) from `update_fn` to each
  kernel call site} of one traced step."""
  found = {'device': set(), 'host': set()}

  def grab(kind):
    frames = [f for f in traceback.extract_stack()[:-3] if f.filename.startswith(ROOT)]
    names = [(os.path.relpath(f.filename, ROOT), f.name) for f in frames]
    start = names.index(('step/transform.py', 'update_fn'))
    found[kind].add(tuple(names[start:]))

  def watched(kind, kernel):
    def call(*args, **kwargs):
      grab(kind)
      return kernel(*args, **kwargs)
    return call

  monkeypatch.setattr(pallas_adamw, 'adamw_pallas_rows_packed',
                      watched('device', pallas_adamw.adamw_pallas_rows_packed))
  for name in ('adamw_host_leaves', 'adamw_host_leaves_redo'):
    monkeypatch.setattr(host_adamw_rows, name, watched('host', getattr(host_adamw_rows, name)))
  params = jax.device_put({f'w{i}': jnp.ones((64, 32), jnp.bfloat16) for i in range(6)},
                          jax.devices()[0])
  opt = dos_jax.adamw(1e-3, offload=dos_jax.Offload(subgroup_size=1024, policy=dos_jax.Stride(2)),
                      implementation=dos_jax.Implementation(program='gpu'))
  if clip:
    opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), opt)
  state = opt.init(params)
  jax.jit(opt.update).trace(jax.tree.map(jnp.ones_like, params), state, params)
  return found


@pytest.mark.parametrize('clip', [False, True], ids=['unclipped', 'clipped'])
def test_kernel_calls_sit_few_frames_below_update(monkeypatch, clip):
  stacks = _stacks(monkeypatch, clip)
  for kind, (most_frames, most_modules) in LIMITS.items():
    assert stacks[kind], f'no {kind} kernel call traced'
    for stack in stacks[kind]:
      modules = {module for module, _ in stack}
      path = ' > '.join(f'{m}:{fn}' for m, fn in stack)
      assert len(stack) <= most_frames and len(modules) <= most_modules, (
          f'{kind}: {len(stack)} frames in {len(modules)} modules: {path}')
  if clip:  # the early calls speculate and are redone after the backward pass
    assert any(fn == 'redo_region' for stack in stacks['host'] for _, fn in stack)
