"""The accelerator program's step in linked chunks (`Offload.chunks`, `dos_jax.step.chunked`)
on the CPU backend (Pallas in interpret mode), per-subgroup storage, fp32 and bf16, with
clipping: the host tier (the native kernel, reading the zero link through its row
indices) is bit for bit the unchunked step's; the streamed rows match within the
suite's tolerance (on the CPU backend XLA fuses the interpreted Pallas kernel's ops with their neighbours, so a
different loop shape may round an FMA differently, as stacked and per-subgroup storage
already do; a GPU runs the same compiled kernel either way); and the step tracks optax.

Seeds: each test derives its seed from its name (`zlib.crc32`), printed on failure.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.step import chunked
from dos_jax.geometry import partition as partition_lib
from tests.test_adamw import SCHEDULE
from tests.test_adamw import decay_mask
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree


def _seed(request) -> int:
  return zlib.crc32(request.node.name.encode()) % (1 << 30)


def _opt(chunks: int, storage: str, clip: bool):
  offload = dos_jax.Offload(subgroup_size=23, policy=dos_jax.Stride(2), platform='gpu',
                            storage=dos_jax.Storage(storage), chunks=chunks)
  adamw = dos_jax.adamw(learning_rate=SCHEDULE, weight_decay=0.05, mask=decay_mask,
                        offload=offload)
  return dos_jax.chain(dos_jax.clip_by_global_norm(0.5), adamw) if clip else adamw


def _run(opt, params, seed, steps):
  params = jax.device_put(params, jax.devices()[0])
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  for t in range(steps):
    params, state = step(params, state, random_grads(params, t, seed))
  return params, state


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_chunked_step_is_the_unchunked_step(dtype, request, storage='per_subgroup'):
  seed = _seed(request)
  params = random_tree(seed, jnp.dtype(dtype))
  want_params, want_state = _run(_opt(0, storage, clip=True), params, seed, steps=4)
  for chunks in (2, 3):
    got_params, got_state = _run(_opt(chunks, storage, clip=True), params, seed, steps=4)
    message = f'seed {seed}, chunks {chunks}'
    for a, b in zip(want_state[-1].host + want_state[-1].scalars,
                    got_state[-1].host + got_state[-1].scalars):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=message)
    for a, b in zip(jax.tree.leaves(want_state) + jax.tree.leaves(want_params),
                    jax.tree.leaves(got_state) + jax.tree.leaves(got_params)):
      # The tolerance of the suite's optax comparisons (tests/test_adamw.py).
      np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                 rtol=1e-6, atol=1e-7, err_msg=message)


def test_chunked_step_matches_optax(request):
  seed = _seed(request)
  params = random_tree(seed)
  got, _ = _run(_opt(2, 'per_subgroup', clip=False), params, seed, steps=6)
  ref_opt = optax.adamw(learning_rate=SCHEDULE, weight_decay=0.05, mask=decay_mask)
  want, _ = _run(ref_opt, params, seed, steps=6)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7,
                               err_msg=f'seed {seed}')


def test_chunk_order_follows_the_backward_pass_and_the_stream():
  plan = dos_jax.Plan(streamed=(0, 2, 4, 6), host=(1, 3, 5, 7))
  part = partition_lib.for_plan(plan, split=True, per_subgroup=True)
  assert [part.blocks(partition_lib.Tier.HOST)[b] for b in chunked.host_blocks(part)] == [
      (7,), (5,), (3,), (1,)]
  # The blocks without weight decay (the norm scales, complete at the end of the
  # backward pass) come last.
  assert [part.blocks(partition_lib.Tier.HOST)[b]
          for b in chunked.host_blocks(part, decayed_rows=6)] == [(5,), (3,), (1,), (7,)]
  assert chunked.stream_blocks(part, plan) == [0, 1, 2, 3]
  assert chunked.chunk_count(part, plan, 8) == 4
  assert chunked.chunk_count(part, plan, 3) == 3


def test_chunks_need_per_subgroup_storage():
  with pytest.raises(ValueError, match='per-subgroup storage'):
    dos_jax.Offload(chunks=2, storage=dos_jax.Storage.STACKED)
  with pytest.raises(ValueError, match='per-subgroup storage'):
    dos_jax.Offload(chunks=2, policy=dos_jax.Stride(2))
  assert dos_jax.Offload(chunks=2, policy=dos_jax.Auto()).chunks == 2
  with pytest.raises(ValueError, match='chunks'):
    dos_jax.Offload(chunks=-1)
