"""ZeRO-3's shard-major packing (`dos_jax.adamw(shard_dims=...)`, `layout.Layout.shards`):
each device's slice of the rows holds its own shards of the leaves, so the update packs
and unpacks locally and gathers no row.

References: a numpy float64 packing of each device's shards written here, and
`optax.adamw` (fp32 master, gradients rounded as the step sees them). Tolerances as in
tests/test_state_ops.py: the native host kernel and the Pallas kernel may round a last
bit differently from XLA's AdamW (rtol 1e-5, atol 1e-6 on params and master).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dos_jax
from dos_jax.geometry import layout as layout_lib
from tests.test_adamw import random_grads
from tests.test_dropin import assert_close
from tests.test_dropin import memory_kinds
from tests.test_dropin import unpacked_master
from tests.test_early_calls import _with_early

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices')

SHARDS = 4
LR = 1e-2
# One leaf per case: split on its first, middle and last dimension, and one replicated
# (norm-scale-like, 6 elements: padded to 8 when its raveled length is split).
SPECS = {'w': P('data', None), 'e': P(None, 'data', None), 'v': P(None, 'data'), 'b': P()}
SHAPES = {'w': (16, 12), 'e': (3, 8, 5), 'v': (12, 8), 'b': (6,)}
DIMS = {'w': 0, 'e': 1, 'v': 1, 'b': None}


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:SHARDS]), ('data',))


def _params(seed, dtype, mesh=None, whole=False):
  """The params, split over the mesh as `SPECS` says (ZeRO-3) or, `whole`, replicated
  on every device (ZeRO-1: the state alone is split)."""
  rng = np.random.default_rng(seed)
  params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in SHAPES.items()}
  if mesh is None:
    return params
  return jax.device_put(params, {k: NamedSharding(mesh, P() if whole else s)
                                 for k, s in SPECS.items()})


def _shard(x: np.ndarray, dim, d: int) -> np.ndarray:
  """Device d's shard of `x`, raveled (dim None: a quarter of the zero-padded ravel)."""
  if dim is None:
    flat = np.ravel(x)
    size = -(-flat.size // SHARDS)
    return np.pad(flat, (0, SHARDS * size - flat.size))[d * size:(d + 1) * size]
  return np.ravel(np.split(x, SHARDS, axis=dim)[d])


def test_each_devices_columns_hold_its_own_shards_and_unpack_inverts(seed):
  params = jax.tree.map(np.asarray, _params(seed, jnp.float32))
  dims = tuple(DIMS[k] for k in sorted(DIMS))  # the dict's leaf order
  layout = layout_lib.make_layout(params, 40, shard_multiple=SHARDS, shard_dims=dims,
                                  decay_flags=(False, True, True, True))
  assert layout.shards == SHARDS and layout.subgroup_size % SHARDS == 0
  rows = np.asarray(layout_lib.pack(params, layout, jnp.float32), np.float64)
  local = layout.subgroup_size // SHARDS
  leaves = layout.treedef.flatten_up_to(params)
  for d in range(SHARDS):
    mine = rows[:, d * local:(d + 1) * local].reshape(-1)
    want = np.zeros_like(mine)
    for i, leaf in enumerate(leaves):
      piece = _shard(leaf, layout.shard_dims[i], d)
      want[layout.offsets[i]:layout.offsets[i] + piece.size] = piece
    np.testing.assert_array_equal(mine, want)
  back = layout_lib.unpack(jnp.asarray(rows, jnp.float32), layout)
  for got, leaf in zip(back, leaves, strict=True):
    np.testing.assert_array_equal(np.asarray(got), leaf)


def test_without_shard_dims_or_a_mesh_the_layout_is_packed_leaf_after_leaf(seed):
  params = _params(seed, jnp.float32)
  plain = layout_lib.make_layout(params, 40, shard_multiple=SHARDS)
  one_shard = layout_lib.make_layout(params, 40, shard_dims=(None,) * 4)
  assert plain.shards == one_shard.shards == 1
  flat = np.concatenate([np.ravel(params[k]) for k in reversed(sorted(params))])
  packed = np.asarray(layout_lib.pack(params, plain, jnp.float32)).reshape(-1)
  np.testing.assert_array_equal(packed[:flat.size], flat)


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=['cpu-program', 'gpu-program'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2), dos_jax.AllDevice()],
                         ids=repr)
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_the_zero3_update_is_optaxs_and_keeps_every_split(platform, policy, dtype, seed):
  mesh = _mesh()
  params = _params(seed, dtype, mesh)
  offload = dos_jax.Offload(subgroup_size=40, policy=policy)
  tx = dos_jax.adamw(LR, offload=offload, shard_dims=DIMS,
                     implementation=dos_jax.Implementation(program=platform))
  state = tx.init(params)
  assert state.layout.shards == SHARDS
  ref = optax.adamw(LR)
  ref_p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  ref_state = ref.init(ref_p)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p, compiles = params, []
  for i in range(3):
    g = jax.device_put(random_grads(params, i, seed), jax.tree.map(lambda x: x.sharding, params))
    p, state = step(p, state, g)
    compiles.append(step._cache_size())  # pylint: disable=protected-access
    u, ref_state = ref.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  if dtype == jnp.float32:
    assert_close(p, ref_p)
  else:  # the fp32 master is optax's; the params are it rounded (see `adamw`)
    assert_close(unpacked_master(state), jax.tree.leaves(ref_p))
    assert_close(p, ref_p, rtol=2 ** -7, atol=1e-4)
  for key in params:
    assert p[key].sharding.is_equivalent_to(params[key].sharding, p[key].ndim), key
  rows = [x for x in jax.tree.leaves(state) if x.ndim == 3 and x.size]
  assert rows and all(x.sharding.spec == P(None, None, 'data') for x in rows)
  assert memory_kinds(state) <= {'pinned_host', 'device'}
  assert compiles[1] == compiles[2]  # the state a step returns compiles no new step


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=['cpu-program', 'gpu-program'])
def test_the_zero1_update_is_optaxs_and_keeps_the_params_whole(platform, seed):
  """ZeRO-1 packed shard-major: the params whole on each of 4 devices, the state split
  over `data` by the leaves' `DIMS` (each device updates its own shards, the new params
  gathered whole). Stride(2), fp32, 3 steps against `optax.adamw`; the params keep
  their replicated sharding and the state rows their split."""
  mesh = _mesh()
  params = _params(seed, jnp.float32, mesh, whole=True)
  offload = dos_jax.Offload(subgroup_size=40, policy=dos_jax.Stride(2))
  tx = dos_jax.adamw(LR, offload=offload, shard_dims=DIMS,
                     implementation=dos_jax.Implementation(program=platform))
  state = tx.init(params)
  assert state.layout.shards == SHARDS
  ref = optax.adamw(LR)
  ref_p, ref_state = params, ref.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p = params
  for i in range(3):
    g = jax.device_put(random_grads(params, i, seed), jax.tree.map(lambda x: x.sharding, params))
    p, state = step(p, state, g)
    u, ref_state = ref.update(g, ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  assert_close(p, ref_p)
  for key in params:
    assert p[key].sharding.is_equivalent_to(params[key].sharding, p[key].ndim), key
  rows = [x for x in jax.tree.leaves(state) if x.ndim == 3 and x.size]
  assert rows and all(x.sharding.spec == P(None, None, 'data') for x in rows)


@pytest.mark.parametrize('policy', [dos_jax.Stride(2),
                                    dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(3))],
                         ids=repr)
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('whole', [False, True], ids=['zero3', 'zero1'])
def test_the_zero3_step_on_two_streams_is_the_step_without_bit_for_bit(policy, dtype, whole,
                                                                       seed):
  """The two-memory program: each device runs the host regions (early host calls
  included) and the stream lanes on its own columns inside `shard_map`
  (`lanes.sharded_two_streams`); without stream regions
  (`Implementation(two_streams=False)`), jit partitions the step.
  Clipping that fires, 3 steps: the same numbers, bit for bit, and every split kept.
  ZeRO-1 (the params whole on every device, the state split shard-major) alike."""
  mesh = _mesh()
  params = _params(seed, dtype, mesh, whole=whole)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  results = []
  for stream in (True, False):
    offload = dos_jax.Offload(subgroup_size=40, policy=policy)
    state, step = _clipped_step(offload, params, two_streams=stream)
    grads = [jax.device_put(jax.tree.map(lambda x: 3 * x, random_grads(params, i, seed)),
                            shardings) for i in range(3)]
    regions = str(jax.make_jaxpr(step)(params, state, grads[0])).count(
        'dos_jax_stream_region[')
    assert (regions > 0) is stream, regions
    results.append(_run(step, params, state, grads))
  _assert_bit_for_bit(*results, params)


def _clipped_step(offload, params, two_streams: bool = True):
  """(state, jitted step) of `dos_jax.adamw` under `offload` on the two-memory program,
  sharded shard-major, behind a global-norm clip at 0.5 (`two_streams`:
  `Implementation.two_streams`)."""
  implementation = dos_jax.Implementation(program='gpu', two_streams=two_streams)
  tx = dos_jax.chain(dos_jax.clip_by_global_norm(0.5),
                     dos_jax.adamw(LR, offload=offload, shard_dims=DIMS,
                                   implementation=implementation))

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return tx.init(params), step


def _run(step, params, state, grads):
  """(params, state) after one step per gradient."""
  for g in grads:
    params, state = step(params, state, g)
  return params, state


def _assert_bit_for_bit(first, second, params):
  """Two runs' (params, state) equal bit for bit, the first's params keeping `params`'
  shardings."""
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for key in params:
    assert first[0][key].sharding.is_equivalent_to(params[key].sharding,
                                                   first[0][key].ndim), key


def _all_gathers(text: str) -> list[int]:
  """Element counts of the all-gathers' results in compiled HLO text."""
  import re  # pylint: disable=import-outside-toplevel
  counts = []
  for match in re.finditer(r'= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? all-gather(-start)?\(', text):
    counts.append(math.prod(int(n) for n in match.group(2).split(',') if n))
  return counts


@pytest.mark.parametrize('policy', [dos_jax.Stride(2), dos_jax.AllDevice()], ids=repr)
def test_the_zero3_update_gathers_no_row(policy, seed):
  """The two-memory program (Pallas kernel per shard on the device tiers): the only
  all-gather left is the replicated leaf's (8 elements); packed leaf after leaf, the
  same step gathers whole rows of state and new params."""
  mesh = _mesh()
  params = _params(seed, jnp.bfloat16, mesh)
  grads = jax.device_put(random_grads(params, 0, seed),
                         jax.tree.map(lambda x: x.sharding, params))
  offload = dos_jax.Offload(subgroup_size=40, policy=policy)

  def gathers(shard_dims):
    tx = dos_jax.adamw(LR, offload=offload, shard_dims=shard_dims,
                       implementation=dos_jax.Implementation(program='gpu'))
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    return _all_gathers(step.lower(params, state, grads).compile().as_text())

  assert max(gathers(DIMS), default=0) <= 8
  assert max(gathers(None)) >= 40  # a whole row (or more) when packed leaf after leaf


def test_jitted_init_equals_eager_init(seed):
  params = _params(seed, jnp.bfloat16, _mesh())
  options = dict(offload=dos_jax.Offload(subgroup_size=40, policy=dos_jax.Stride(2)),
                 shard_dims=DIMS, implementation=dos_jax.Implementation(program='gpu'))
  eager = dos_jax.adamw(LR, **options).init(params)
  jitted = jax.jit(dos_jax.adamw(LR, **options).init)(params)
  assert jitted.layout == eager.layout and jitted.layout.shards == SHARDS
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('platform', ['cpu', 'gpu'], ids=['cpu-program', 'gpu-program'])
def test_explicit_mesh_axes_update_as_optax(platform, seed):
  mesh = jax.make_mesh((SHARDS,), ('data',), devices=jax.devices()[:SHARDS],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  params = _params(seed, jnp.float32, mesh)
  offload = dos_jax.Offload(subgroup_size=40, policy=dos_jax.Stride(2))
  tx = dos_jax.adamw(LR, offload=offload, shard_dims=DIMS,
                     implementation=dos_jax.Implementation(program=platform))
  ref = optax.adamw(LR)
  state = tx.init(params)
  assert state.layout.shards == SHARDS
  grads = random_grads(params, 0, seed)
  updates, _ = jax.jit(lambda p, s, g: tx.update(g, s, p))(params, state, grads)
  want, _ = ref.update(grads, ref.init(params), params)
  assert_close(updates, want)
  for key in params:
    assert updates[key].sharding.is_equivalent_to(params[key].sharding, params[key].ndim), key


def test_a_state_crosses_between_shard_major_and_leaf_major(seed):
  """`state_to_pytrees` / `state_from_pytrees` (what the runner's checkpoints hold):
  a leaf-major state (saved before shard-major packing existed) restores into a
  shard-major one and back, value for value."""
  params = _params(seed, jnp.bfloat16, _mesh())
  offload = dos_jax.Offload(subgroup_size=40, policy=dos_jax.Stride(2))
  leaf_major = dos_jax.adamw(LR, offload=offload)
  shard_major = dos_jax.adamw(LR, offload=offload, shard_dims=DIMS)
  state = leaf_major.init(params)
  step = jax.jit(lambda p, s, g: leaf_major.update(g, s, p))
  _, state = step(params, state, random_grads(params, 0, seed))
  trees = dos_jax.state_to_pytrees(state, params)
  moved = dos_jax.state_from_pytrees(trees, params, shard_major)
  assert moved.layout.shards == SHARDS and state.layout.shards == 1
  back = dos_jax.state_to_pytrees(moved, params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(trees), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again = dos_jax.state_from_pytrees(back, params, leaf_major)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_sharding_table_gives_each_params_fsdp_dimension():
  from dos_jax.train import sharding  # pylint: disable=import-outside-toplevel
  shapes = {'embedding': (32, 16), 'head': (16, 32), 'final_norm': {'scale': (16,)},
            'blocks': {'0': {'attn': {'wq': (16, 2, 8), 'wo': (2, 8, 16)},
                             'mlp': {'w_gate': (16, 24), 'w_down': (24, 16)}}}}
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  dims = sharding.fsdp_dims(params)
  assert dims['embedding'] == 1 and dims['head'] == 0 and dims['final_norm']['scale'] is None
  block = dims['blocks']['0']
  assert (block['attn']['wq'], block['attn']['wo']) == (0, 2)
  assert (block['mlp']['w_gate'], block['mlp']['w_down']) == (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [['mesh.fsdp=4'], ['mesh.fsdp=2', 'mesh.tensor=2'],
                                  ['mesh.data=4'], ['mesh.data=2', 'mesh.tensor=2']],
                         ids=['fsdp4', 'fsdp2xtensor2', 'data4', 'data2xtensor2'])
def test_the_runners_zero3_step_with_shard_major_packing_matches_one_device(mesh, tmp_path):
  """The two-memory program's shard-major packing on mesh.fsdp=4 (and 2 x tensor=2)
  (`offload.platform=gpu` on the CPU backend) against one device, 6
  steps (fp32 compute; tolerances as tests/test_fsdp.py: 1e-4 relative on losses, 1e-4
  absolute on params). With ZeRO-1 (mesh.data=4, and 2 x tensor=2) the params are whole
  on each data shard and the state is packed by the same table's dimensions, split over
  `data`."""
  from dos_jax.train import config, data, trainer  # pylint: disable=import-outside-toplevel
  from dos_jax.train import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  out = str(tmp_path / 'tokens')
  data.prepare(None, out, val_fraction=0.05, max_bytes=200_000, progress=False)
  common = [f'data.path={out}', 'model.n_layers=2', 'model.compute_dtype=float32',
            'data.seq_len=32', 'data.batch_size=8', 'optim.lr=3e-3', 'train.steps=6',
            'train.eval_every=0', 'offload.subgroup_size=100000', 'offload.policy=stride',
            'offload.platform=gpu']
  one = trainer.build(config.load(None, common + ['mesh.data=1']), devices=jax.devices()[:1])
  zero3 = trainer.build(config.load(None, common + ['mesh.data=1', *mesh]),
                        devices=jax.devices()[:4])
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  states = [x for x in jax.tree.leaves(zero3.opt_state, is_leaf=is_state) if is_state(x)]
  assert [s.layout.shards for s in states] == [zero3.mesh.shape[mesh_lib.state_axis(zero3.mesh)]]
  sampler = one.train_sampler()
  for _ in range(6):
    batch = next(sampler)
    np.testing.assert_allclose(zero3.step(batch).loss, one.step(batch).loss, rtol=1e-4)
  for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(zero3.params), strict=True):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-4)
  assert zero3.compile_counts() == {'fused': 1, 'grad': 0, 'update': 0}


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
def test_the_zero3_early_calls_are_the_one_call_step_bit_for_bit(dtype, seed):
  """Early host calls on a state sharded shard-major: each device runs them inside
  `shard_map`, on its own columns (`lanes.sharded_two_streams`). Against the same step
  with one host call: bit for bit over 4 steps, with clipping that fires (a rollback)
  on steps 0 and 2 and not on 1 and 3, and every split kept."""
  mesh = _mesh()
  params = _params(seed, dtype, mesh)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  scales = (30.0, 1e-3, 30.0, 1e-3)
  grads = [jax.device_put(jax.tree.map(lambda x, k=k: k * x, random_grads(params, i, seed)),
                          shardings) for i, k in enumerate(scales)]
  results = []
  for early in (2, 0):
    offload = dos_jax.Offload(subgroup_size=40, policy=dos_jax.Stride(2))
    state, step = _clipped_step(offload, params)
    state = _with_early(state, early)
    text = str(jax.make_jaxpr(step)(params, state, grads[0]))
    assert ('shard_map' in text) and ('dos_jax_stream_region[' in text)
    lowered = step.lower(params, state, grads[0]).as_text()
    assert ('_dos_jax_early_call' in lowered) is (early > 0)  # the early calls are built
    results.append(_run(step, params, state, grads))
  _assert_bit_for_bit(*results, params)
