"""The disk tier of a state split over a mesh's data axis: ZeRO-1 (leaf-major) and ZeRO-3's
shard-major packing (`shard_dims`), in both programs, and copies of the state on a mesh's
other axes. Each device's kernel call updates its own columns of the rows in its own
files (`sg<g>.s<i>.<half>`); the numbers are the
in-memory host tier's on the same mesh, bit for bit (that tier is checked against optax
in tests/test_shard_major.py), and a checkpoint of files restores into its own packing
and refuses another in one line.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dos_jax
from dos_jax.kernels import host_adamw_disk
from tests.test_adamw import random_grads
from tests.test_shard_major import _mesh
from tests.test_shard_major import SPECS
from tests.test_shard_major import _params
from tests.test_shard_major import DIMS
from tests.test_shard_major import SHARDS

pytestmark = [
    pytest.mark.skipif(not host_adamw_disk.disk_kernel_available(),
                       reason='the native disk kernel is not built'),
    pytest.mark.skipif(jax.device_count() < SHARDS, reason='needs 4 (virtual) devices'),
]

SIZE = 40  # elements per subgroup: 11 subgroups of the 4 leaves


def _make(platform, zero3, policy, disk=None):
  offload = dos_jax.Offload(subgroup_size=SIZE, policy=policy, disk=disk)
  return dos_jax.adamw(1e-2, weight_decay=0.05, offload=offload,
                       implementation=dos_jax.Implementation(program=platform),
                       shard_dims=DIMS if zero3 else None)


def _step(tx):
  return jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))


def _train(tx, params, seed, steps):
  state, step, p = tx.init(params), _step(tx), params
  for i in range(steps):
    g = jax.device_put(random_grads(params, i, seed), jax.tree.map(lambda x: x.sharding, params))
    p, state = step(p, state, g)
  return p, state


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _on_mesh(seed, zero3, data, tensor):
  """bf16 params on a `data x tensor` mesh: ZeRO-3 split over `data` as `SPECS` says,
  ZeRO-1 whole on each data shard; `w` also split over `tensor`."""
  mesh = Mesh(np.array(jax.devices()[:data * tensor]).reshape(data, tensor), ('data', 'tensor'))
  specs = {k: P(*(None if a == 'data' and not zero3 else a for a in s))
           for k, s in SPECS.items()}
  specs['w'] = P(specs['w'][0], 'tensor')
  params = _params(seed, jnp.bfloat16)
  return jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})


CASES = [  # (program, ZeRO-3, policy, host subgroups the budget keeps in memory, mesh)
    ('cpu', True, dos_jax.AllHost(), 0, (4, 1)),
    ('gpu', False, dos_jax.AllHost(), 3, (4, 1)),
    ('gpu', True, dos_jax.Stride(2), 2, (4, 1)),
    ('gpu', True, dos_jax.AllHost(), 0, (2, 2)),  # two copies of each data shard
    ('cpu', False, dos_jax.AllHost(), 0, (1, 4)),  # the state whole on 4 devices
]


@pytest.mark.parametrize('platform,zero3,policy,in_memory,mesh', CASES, ids=[
    f'{p}-program-{"zero3" if z else "zero1"}-{q!r}-{m}-in-memory-data{d}xtensor{t}'
    for p, z, q, m, (d, t) in CASES])
def test_each_device_updates_its_own_files_as_the_in_memory_tier(
    platform, zero3, policy, in_memory, mesh, tmp_path, seed):
  """3 steps: params and every state row equal the in-memory host tier's on the same
  mesh; each disk subgroup has one file per device (its data shard's columns, its own
  copy) and half, nothing else."""
  params = _on_mesh(seed, zero3, *mesh)
  row_bytes = 3 * 4 * SIZE  # master, mu and nu in fp32
  disk = dos_jax.Disk(str(tmp_path / 'state'), host_state_bytes=in_memory * row_bytes)
  ours, state = _train(_make(platform, zero3, policy, disk), params, seed, 3)
  ref, ref_state = _train(_make(platform, zero3, policy), params, seed, 3)
  part = state.partition
  assert state.layout.shards == (mesh[0] if zero3 else 1)
  assert (part.disk_shards, part.disk_replicas) == mesh
  assert part.disk and len(part.host) == in_memory and int(state.disk_gen) == 3
  _assert_equal(ours, ref)
  _assert_equal(state.rows(), ref_state.rows())
  names = sorted(os.listdir(tmp_path / 'state'))
  assert names == sorted(os.path.basename(host_adamw_disk.state_path('', g, h, d))
                         for g in part.disk for d in range(mesh[0] * mesh[1]) for h in (0, 1))


def test_a_shard_major_checkpoint_of_files_resumes_in_its_packing_only(tmp_path, seed):
  """ZeRO-3 (shard-major) in the two-memory program, all on disk: `state_to_files` and
  `state_from_files` into a fresh state of the same packing, then one more step, equal
  the run that went on bit for bit; a target packed leaf after leaf (ZeRO-1 on the same
  mesh) is refused in one line."""
  params = _params(seed, jnp.bfloat16, _mesh())
  tx = _make('gpu', True, dos_jax.AllHost(), dos_jax.Disk(str(tmp_path / 'a')))
  p, state = _train(tx, params, seed, 2)
  folder = str(tmp_path / 'ckpt')
  saved = dos_jax.state_to_files(state, folder)
  again = _make('gpu', True, dos_jax.AllHost(), dos_jax.Disk(str(tmp_path / 'b')))
  restored = dos_jax.state_from_files(saved, folder, again.init(params))
  grads = jax.device_put(random_grads(params, 5, seed), jax.tree.map(lambda x: x.sharding, p))
  (a, state_a), (b, state_b) = _step(tx)(p, state, grads), _step(again)(p, restored, grads)
  _assert_equal(a, b)
  _assert_equal(state_a.rows(), state_b.rows())
  assert dos_jax.files_packing_mismatch(folder, restored) is None
  leaf_major = _make('gpu', False, dos_jax.AllHost(), dos_jax.Disk(str(tmp_path / 'c')))
  with pytest.raises(ValueError, match=r'^the checkpoint\'s optimizer state is packed '
                     r'shard-major over 4 devices .*, this run\'s leaf after leaf'):
    dos_jax.state_from_files(saved, folder, leaf_major.init(params))
