"""The disk tier (`dos_jax.Disk`): the same numbers as the in-memory host tier, bit for bit,
for every policy mix with disk subgroups, in both programs; optax's with clipping and a
NaN step; checkpoints from disk to memory and back, as layout-independent trees and as
one file per subgroup (`state_to_files`: the disk tier's files hard-linked)."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.geometry import partition as partition_lib
from dos_jax.kernels import host_adamw_disk

from tests.test_adamw import decay_mask
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree
from tests.test_adamw import SCHEDULE

pytestmark = pytest.mark.skipif(not host_adamw_disk.disk_kernel_available(),
                                reason='the native disk kernel is not built')

SIZE = 23  # elements per subgroup: 13 subgroups for random_tree


def row_bytes(dtype=jnp.float32) -> int:
  """One subgroup's state: fp32 mu and nu, and a master for 16-bit params."""
  return (2 if jnp.dtype(dtype) == jnp.float32 else 3) * 4 * SIZE


def _make(policy, platform, disk=None, clip=None):
  offload = dos_jax.Offload(subgroup_size=SIZE, policy=policy, disk=disk)
  tx = dos_jax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask, offload=offload,
                     implementation=dos_jax.Implementation(program=platform))
  return tx if clip is None else dos_jax.chain(dos_jax.clip_by_global_norm(clip), tx)


def _step(tx):
  """`tx`'s update and apply, jitted: `(params, state, grads) -> (params, state)`."""
  return jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))


def _budget(tmp_path, cap, name):
  """A disk tier in `tmp_path/name` whose host budget holds `cap` bf16 subgroups (None:
  no disk tier)."""
  return None if cap is None else dos_jax.Disk(
      str(tmp_path / name), host_state_bytes=cap * row_bytes(jnp.bfloat16))


def _train(tx, params, seed, steps, nan_at=(), scale=1.0):
  params = jax.device_put(params, jax.devices()[0])
  state = tx.init(params)
  step = _step(tx)
  for i in range(steps):
    grads = jax.tree.map(lambda g: scale * (1 + i) * g, random_grads(params, i, seed))
    if i in nan_at:
      grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    params, state = step(params, state, grads)
  return params, state


def _offloaded(state):
  return next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, dos_jax.OffloadedState)) if isinstance(x, dos_jax.OffloadedState))


CASES = [  # (program, policy, subgroups the host-memory budget holds, param dtype)
    ('cpu', dos_jax.AllHost(), 0, jnp.bfloat16),  # one memory, every subgroup on disk
    ('cpu', dos_jax.AllHost(), 5, jnp.float32),  # one memory, 5 subgroups in memory
    ('gpu', dos_jax.AllHost(), 3, jnp.bfloat16),  # two-memory program, early calls in memory
    ('gpu', dos_jax.Stride(2), 2, jnp.float32),  # streamed, host in memory and on disk
    ('gpu', dos_jax.DeviceFraction(0.4), 0, jnp.bfloat16),
]


def _ids(cases):
  return [f'{p}-program-{q!r}-{m}-in-memory-{jnp.dtype(d).name}' for p, q, m, d in cases]


@pytest.mark.parametrize('platform,policy,in_memory,dtype', CASES, ids=_ids(CASES))
def test_disk_subgroups_take_the_in_memory_host_tiers_steps_bit_for_bit(
    platform, policy, in_memory, dtype, tmp_path, seed):
  _check_against_the_in_memory_tier(platform, policy, in_memory, dtype, tmp_path, seed)


GPU_CASES = [c for c in CASES if c[0] == 'gpu']


@pytest.mark.gpu
@pytest.mark.parametrize('platform,policy,in_memory,dtype', GPU_CASES, ids=_ids(GPU_CASES))
def test_on_a_gpu_disk_subgroups_take_the_in_memory_host_tiers_steps_bit_for_bit(
    platform, policy, in_memory, dtype, tmp_path, seed):
  """The two-memory program on a GPU: the disk kernel runs in the CUDA plugin's host
  regions (registered there and probed) and agrees with the in-memory host tier."""
  assert jax.devices()[0].platform == 'gpu'
  assert host_adamw_disk.disk_kernel_in_two_memory_programs() == (True, '')
  _check_against_the_in_memory_tier(platform, policy, in_memory, dtype, tmp_path, seed)


def _check_against_the_in_memory_tier(platform, policy, in_memory, dtype, tmp_path, seed):
  params = random_tree(seed, dtype)
  disk = dos_jax.Disk(str(tmp_path / 'state'), host_state_bytes=in_memory * row_bytes(dtype))
  ours, state = _train(_make(policy, platform, disk, clip=1.0), params, seed, 4, scale=0.5)
  ref, ref_state = _train(_make(policy, platform, clip=1.0), params, seed, 4, scale=0.5)
  inner, ref_inner = _offloaded(state), _offloaded(ref_state)
  assert inner.partition.disk and len(inner.partition.host) <= in_memory
  assert int(inner.disk_gen) == 4
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(inner.rows(), ref_inner.rows(), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Only the two generations' files are there: nothing left behind.
  names = sorted(os.listdir(tmp_path / 'state'))
  assert names == sorted(f'sg{g:06d}.{h}' for g in inner.partition.disk for h in (0, 1))


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=['cpu-program', 'gpu-program'])
def test_clipping_and_a_skipped_nan_step_are_optaxs(platform, tmp_path, seed):
  """apply_if_finite keeps the old generation on the NaN step, whose files the step did
  not overwrite: training on equals optax's with the step skipped (fp32, clipping)."""
  params = random_tree(seed)
  disk = dos_jax.Disk(str(tmp_path / 'state'), host_state_bytes=4 * row_bytes())
  make = lambda: optax.apply_if_finite(_make(dos_jax.Stride(3), platform, disk, clip=2.0), 5)
  ours, state = _train(make(), params, seed, 5, nan_at=(2,))
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1
  assert int(_offloaded(state).disk_gen) == 4  # the NaN step did not advance it
  ref_tx = optax.apply_if_finite(optax.chain(
      optax.clip_by_global_norm(2.0),
      optax.adamw(SCHEDULE, weight_decay=0.05, mask=decay_mask)), 5)
  ref, _ = _train(ref_tx, params, seed, 5, nan_at=(2,))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('source,target', [(0, None), (None, 0), (0, 6)],
                         ids=['disk-to-memory', 'memory-to-disk', 'disk-to-other-split'])
def test_checkpoint_trees_restore_across_the_disk_split(source, target, tmp_path, seed):
  """`state_to_pytrees` reads the disk tier; `state_from_pytrees` writes it for another
  split (None: no disk tier): training on from the restored state is training on from
  the saved one, bit for bit."""
  params = jax.device_put(random_tree(seed, jnp.bfloat16), jax.devices()[0])
  saved_tx = _make(dos_jax.AllHost(), 'cpu', _budget(tmp_path, source, 'a'))
  p, state = _train(saved_tx, params, seed, 3)
  trees = dos_jax.state_to_pytrees(state, p)
  new_tx = _make(dos_jax.AllHost(), 'cpu', _budget(tmp_path, target, 'b'))
  restored = dos_jax.state_from_pytrees(trees, p, new_tx)
  grads = random_grads(p, 7, seed)
  a, _ = _step(saved_tx)(p, state, grads)
  b, _ = _step(new_tx)(p, restored, grads)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=lambda p: f'{p}-program')
@pytest.mark.parametrize('target', [0, None, 6, 13], ids=[
    'same-split', 'disk-to-memory', 'another-split', 'all-in-memory-with-a-disk'])
def test_state_files_restore_across_the_disk_split_without_unpacking(
    platform, target, tmp_path, seed):
  """`state_to_files` hard-links the disk tier's files and writes the rest, one file
  per subgroup; `state_from_files` fills a fresh state of any split (None: no disk
  tier) from them: training on is bit for bit training on from the saved state; the
  checkpoint's files keep their bytes while the run goes on."""
  params = jax.device_put(random_tree(seed, jnp.bfloat16), jax.devices()[0])
  saved_tx = _make(dos_jax.AllHost(), platform, _budget(tmp_path, 3, 'a'), clip=1.0)
  p, state = _train(saved_tx, params, seed, 3)
  assert dos_jax.has_disk_tier(state)
  folder = str(tmp_path / 'ckpt')
  saved = dos_jax.state_to_files(state, folder)
  live = host_adamw_disk.state_path(str(tmp_path / 'a'), 0, int(_offloaded(state).disk_gen) % 2)
  kept = host_adamw_disk.state_path(os.path.join(folder, '0'), 0, 0)
  assert os.stat(live).st_ino == os.stat(kept).st_ino  # a link, not a copy
  before = pathlib.Path(kept).read_bytes()
  new_tx = _make(dos_jax.AllHost(), platform, _budget(tmp_path, target, 'b'), clip=1.0)
  restored = dos_jax.state_from_files(saved, folder, new_tx.init(p))
  grads = random_grads(p, 7, seed)
  a, state_a = _step(saved_tx)(p, state, grads)
  b, _ = _step(new_tx)(p, restored, grads)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  _step(saved_tx)(a, state_a, grads)  # the step after next replaces the linked file
  assert pathlib.Path(kept).read_bytes() == before


def test_state_files_refuse_other_subgroups_in_one_line(tmp_path, seed):
  params = jax.device_put(random_tree(seed, jnp.bfloat16), jax.devices()[0])
  _, state = _train(_make(dos_jax.AllHost(), 'cpu', dos_jax.Disk(str(tmp_path / 'a'))),
                    params, seed, 1)
  saved = dos_jax.state_to_files(state, str(tmp_path / 'ckpt'))
  other = dos_jax.adamw(SCHEDULE, offload=dos_jax.Offload(
      subgroup_size=SIZE + 1, disk=dos_jax.Disk(str(tmp_path / 'b'))))
  with pytest.raises(ValueError, match=r'^the checkpoint\'s optimizer state has '
                     r'num_subgroups=13, this run 12: resume with the offload.subgroup_size'):
    dos_jax.state_from_files(saved, str(tmp_path / 'ckpt'), other.init(params))


def test_the_spill_keeps_the_last_subgroups_in_memory():
  plan = dos_jax.Plan(streamed=(1, 4), host=(0, 2, 3, 5, 6))
  part = partition_lib.for_plan(plan, True, disk=partition_lib.DiskSpill('/d', in_memory=2))
  assert part.host == (5, 6) and part.disk == (0, 2, 3) and part.streamed == (1, 4)
  assert part.early == (1,)  # early calls over the host subgroups in memory
  assert part.plan == plan.__class__(streamed=(1, 4), host=(0, 2, 3, 5, 6))
  everything = partition_lib.for_plan(plan, False, disk=partition_lib.DiskSpill('/d'))
  assert everything.host == () and everything.disk == tuple(range(7))


def test_bad_disk_settings_get_one_line(tmp_path, seed):
  with pytest.raises(ValueError, match='Disk.host_state_bytes'):
    dos_jax.Disk(str(tmp_path), host_state_bytes=-1)
  with pytest.raises(TypeError, match='Offload.disk'):
    dos_jax.Offload(disk=str(tmp_path))
  tx = dos_jax.adamw(1e-3, mu_dtype=jnp.bfloat16, offload=dos_jax.Offload(
      subgroup_size=SIZE, disk=dos_jax.Disk(str(tmp_path))))
  with pytest.raises(ValueError, match='Offload.disk holds the state of dos_jax.adamw'):
    tx.init(jax.device_put(random_tree(seed), jax.devices()[0]))


def test_a_missing_state_file_names_the_file(tmp_path, seed):
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  tx = _make(dos_jax.AllHost(), 'cpu', dos_jax.Disk(str(tmp_path / 'state')))
  state = tx.init(params)
  os.remove(tmp_path / 'state' / 'sg000003.0')
  with pytest.raises(Exception, match='sg000003.0'):
    jax.block_until_ready(tx.update(random_grads(params, 0, seed), state, params))

