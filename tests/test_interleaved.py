"""Stacked storage keeps the streamed tier in `buffers` interleaved blocks, by position
in the stream
(`Partition.blocks`, `paths.interleaved_loop`): the numbers are the per-subgroup
storage's to the last bit or so (XLA on CPU fuses a row's update differently by loop
shape: 1e-6 relative) and optax's within the suite's tolerance, for odd and even
streamed row counts and 2 or 3 buffers."""

import dataclasses

import jax
import numpy as np
import pytest

import dos_jax
from dos_jax.geometry.partition import Tier
from tests.test_adamw import jit_step
from tests.test_adamw import make_pair
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

# random_tree has 284 elements: these subgroup sizes give 3 and 7 subgroups (Stride(2):
# 2 and 4 streamed, Stride(1): 3 and 7).
SIZES = (95, 41)


def _run(policy, size, storage, impl, seed, steps=3):
  ours, ref = make_pair(policy, subgroup_size=size, impl=impl, platform='gpu',
                        storage=storage)
  params = ref_params = jax.device_put(random_tree(seed), jax.devices()[0])
  state, ref_state = ours.init(params), ref.init(params)
  step, ref_step = jit_step(ours), jit_step(ref)
  for i in range(steps):
    grads = random_grads(params, i, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  return params, state, ref_params


@pytest.mark.parametrize('buffers', [2, 3])
@pytest.mark.parametrize('size', SIZES)
@pytest.mark.parametrize('stride', [1, 2])
def test_interleaved_blocks_equal_per_subgroup_storage_and_optax(stride, size, buffers, seed):
  policy = dos_jax.Stride(stride, buffers=buffers)
  xla = dos_jax.UpdateImpl.XLA
  params, state, ref_params = _run(policy, size, dos_jax.Storage.STACKED, xla, seed)
  part = state.partition
  streamed = part.ids(Tier.STREAMED)
  count = min(buffers, len(streamed))
  if count > 1:
    assert part.blocks(Tier.STREAMED) == tuple(streamed[k::count] for k in range(count))
  assert len(state.streamed) == len(part.blocks(Tier.STREAMED)) * len(state.slots.groups)
  per_params, per_state, _ = _run(policy, size, dos_jax.Storage.PER_SUBGROUP, xla, seed)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(per_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  for a, b in zip(state.rows(), per_state.rows()):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_interleaved_blocks_with_the_pallas_kernel_match_optax(seed):
  """The Pallas row kernel (interpret mode on CPU) inside the interleaved loop."""
  size = 41
  params, _, ref_params = _run(dos_jax.Stride(1), size, dos_jax.Storage.STACKED,
                               dos_jax.UpdateImpl.KERNEL, seed)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class Backwards:
  """Every other subgroup streamed, last first (the backward pass's order); the rest on
  the host."""

  buffers: int = 2

  def plan(self, spec):
    n = spec.num_subgroups
    return dos_jax.Plan(streamed=tuple(range(n - 1, -1, -2)),
                        host=tuple(range(n - 2, -1, -2)), buffers=self.buffers)


@pytest.mark.parametrize('buffers', [2, 3])
def test_a_stream_in_any_order_is_interleaved_by_position(buffers, seed):
  """A stream out of ascending order: block k holds positions k, k + B, ... (each block
  stored ascending) and the numbers are the per-subgroup storage's and optax's."""
  policy = Backwards(buffers)
  xla = dos_jax.UpdateImpl.XLA
  params, state, ref_params = _run(policy, 41, dos_jax.Storage.STACKED, xla, seed)
  part = state.partition
  stream = policy.plan(state.layout.spec()).streamed
  count = min(buffers, len(stream))
  assert part.blocks(Tier.STREAMED) == tuple(tuple(sorted(stream[k::count]))
                                             for k in range(count))
  per_params, _, _ = _run(policy, 41, dos_jax.Storage.PER_SUBGROUP, xla, seed)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(per_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
