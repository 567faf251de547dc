"""On 8 CPU devices: a data x tensor sharded run matches the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dos_jax
from tests.test_adamw import random_grads


# The two-memory program (stored per subgroup), run on the CPU backend; `{}`: the
# backend's, the one-memory program (one array).
TWO_MEMORIES = dict(implementation=dos_jax.Implementation(program='gpu'))


@pytest.mark.skipif(jax.device_count() < 8, reason='needs 8 (virtual) devices')
@pytest.mark.parametrize('policy, extra', [
    (dos_jax.AllHost(), {}), (dos_jax.Stride(2), {}),
    # The two-memory program stored per subgroup, moved to AllHost after two steps.
    (dos_jax.ResidentFraction(0.5, then=dos_jax.Stride(2)), TWO_MEMORIES)],
    ids=lambda v: ('two-memories' if v else 'one-memory') if isinstance(v, dict) else repr(v))
def test_sharded_matches_unsharded(policy, extra, seed):
  rng = np.random.default_rng(seed)
  params = {'w1': jnp.asarray(rng.standard_normal((16, 24)), jnp.float32),
            'w2': jnp.asarray(rng.standard_normal((24, 16)), jnp.float32),
            'b': jnp.asarray(rng.standard_normal((24,)), jnp.float32)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('data', 'tensor'))
  specs = {'w1': P(None, 'tensor'), 'w2': P('tensor', None), 'b': P('tensor')}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  sharded = jax.device_put(params, shardings)
  opt = dos_jax.adamw(1e-2, offload=dos_jax.Offload(subgroup_size=150, policy=policy), **extra)

  def train(p):
    state = opt.init(p)
    plan = policy.plan(state.layout.spec())
    step = jax.jit(lambda p, s, g, plan: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p, plan=plan)), static_argnames='plan')
    for i in range(5):
      g = random_grads(params, i, seed)
      if isinstance(jax.tree.leaves(p)[0].sharding, NamedSharding):
        g = jax.device_put(g, shardings)
      if i == 2 and extra:
        plan = dos_jax.AllHost().plan(state.layout.spec())
        state = dos_jax.migrate(state, plan)
      p, state = step(p, state, g, plan=plan)
    return p, state

  ref, _ = train(params)
  out, state = train(sharded)
  for key in params:
    np.testing.assert_allclose(out[key], ref[key], rtol=1e-5, atol=1e-6)
    assert out[key].sharding.is_equivalent_to(shardings[key], out[key].ndim), key
  # ZeRO-1: the host state is split over the data axis, in pinned_host memory.
  leaves = [x for x in jax.tree.leaves(state) if x.ndim == 3 and x.size]
  assert leaves
  assert state.partition.two_memories == bool(extra)
  for leaf in leaves:
    if leaf.ndim == 3:
      assert leaf.sharding.memory_kind == 'pinned_host'
      assert leaf.sharding.spec == P(None, None, "data")
      assert leaf.shape[2] % 4 == 0


@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 (virtual) devices')
@pytest.mark.parametrize('extra', [{}, TWO_MEMORIES], ids=['one-memory', 'two-memories'])
def test_explicit_axes_mesh_is_accepted(extra):
  """Explicit mesh axes (jax.make_mesh's default) shard the state like Auto ones; the
  steps' numbers are checked in tests/test_dropin.py."""
  mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  params = {'w': jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('data', None)))}
  offload = dos_jax.Offload(subgroup_size=16, policy=dos_jax.Stride(2))
  state = dos_jax.adamw(1e-3, offload=offload, **extra).init(params)
  assert state.partition.two_memories == bool(extra)
  rows = [x for x in jax.tree.leaves(state) if x.ndim == 3 and x.size]
  assert rows and all(x.sharding.spec == P(None, None, 'data') for x in rows)


@pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices')
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2), dos_jax.AllDevice()],
                         ids=repr)
def test_sharded_state_runs_the_native_kernel_per_shard(policy, dtype, seed):
  """data=2 x tensor=2: every data shard of the state is updated by the native host
  AdamW under shard_map (not XLA's row loop), and the result is optax's."""
  from dos_jax.kernels import host_adamw_rows  # pylint: disable=import-outside-toplevel
  if not host_adamw_rows.rows_kernel_available():
    pytest.skip(host_adamw_rows.rows_kernel_unavailable_reason())
  rng = np.random.default_rng(seed)
  master = {'w1': jnp.asarray(rng.standard_normal((16, 24)), jnp.float32),
            'w2': jnp.asarray(rng.standard_normal((24, 16)), jnp.float32),
            'b': jnp.asarray(rng.standard_normal((24,)), jnp.float32)}
  params = jax.tree.map(lambda x: x.astype(dtype), master)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('data', 'tensor'))
  specs = {'w1': P(None, 'tensor'), 'w2': P('tensor', None), 'b': P('tensor')}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  opt = dos_jax.adamw(1e-2, offload=dos_jax.Offload(subgroup_size=150, policy=policy))
  ref = optax.adamw(1e-2)

  def step_fn(opt, grad_dtype=None):
    def step(p, s, g):
      if grad_dtype is not None:
        g = jax.tree.map(lambda x: x.astype(grad_dtype), g)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s
    return jax.jit(step)

  p = jax.device_put(params, shardings)
  state = opt.init(p)
  step = step_fn(opt)
  text = step.lower(p, state, jax.device_put(params, shardings)).compile().as_text()
  assert 'dos_jax_adamw_host_rows' in text
  ref_p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  ref_state, ref_step = ref.init(ref_p), step_fn(ref, jnp.float32)
  for i in range(4):
    g = random_grads(params, i, seed)
    p, state = step(p, state, jax.device_put(g, shardings))
    ref_p, ref_state = ref_step(ref_p, ref_state, g)
  for key in params:
    got = np.asarray(p[key], np.float32)
    want = np.asarray(ref_p[key].astype(dtype), np.float32)
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # bf16 params: the cast of an fp32 master within an ulp of optax's, plus
      # where a bf16 update rounds (a value crossing zero): half a bf16 ulp of one
      # step's change, < 4 * lr * 2**-8 (see test_adamw.assert_params_track_master).
      np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=4 * 1e-2 * 2 ** -8)
    assert p[key].sharding.is_equivalent_to(shardings[key], p[key].ndim), key
  rows = [x for x in jax.tree.leaves(state) if x.ndim == 3 and x.size]
  assert all(x.sharding.spec == P(None, None, 'data') for x in rows)


@pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices')
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', [dos_jax.AllHost(), dos_jax.Stride(2)], ids=repr)
def test_sharded_two_memory_program_runs_the_native_kernel_per_shard(policy, dtype, seed):
  """The two-memory program (`Implementation(program='gpu')`, run on the CPU backend) on data=2 x
  tensor=2: the host tier's data shards are updated by the native host AdamW, one call
  per shard inside a host region; the result is optax's, and the host tier is bit for
  bit the unsharded program's (the native kernel on one device).

  (XLA's host loop is no bit-exact reference: stored per subgroup it rounds a few
  elements an ulp apart from the kernel, on one device too; and the device stream on
  a mesh rounds a few elements apart from one device's, whatever the host does.)"""
  from dos_jax.kernels import host_adamw_rows  # pylint: disable=import-outside-toplevel
  if not host_adamw_rows.rows_kernel_available():
    pytest.skip(host_adamw_rows.rows_kernel_unavailable_reason())
  rng = np.random.default_rng(seed)
  params = {'w1': jnp.asarray(rng.standard_normal((16, 24)), dtype),
            'w2': jnp.asarray(rng.standard_normal((24, 16)), dtype),
            'b': jnp.asarray(rng.standard_normal((24,)), dtype)}
  mask = {'w1': True, 'w2': True, 'b': False}
  lr = optax.linear_schedule(1e-2, 1e-3, 10)  # array scalars cross into every shard
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('data', 'tensor'))
  specs = {'w1': P(None, 'tensor'), 'w2': P('tensor', None), 'b': P('tensor')}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

  def train(opt, grad_dtype=None, sharded=True):
    put = (lambda t: jax.device_put(t, shardings)) if sharded else (lambda t: t)

    @jax.jit
    def step(p, s, g):
      if grad_dtype is not None:
        g = jax.tree.map(lambda x: x.astype(grad_dtype), g)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    p = put(params if grad_dtype is None else
            jax.tree.map(lambda x: x.astype(grad_dtype), params))
    state = opt.init(p)
    text = step.lower(p, state, put(params)).compile().as_text()
    for i in range(4):
      p, state = step(p, state, put(random_grads(params, i, seed)))
    return p, state, text

  options = dict(offload=dos_jax.Offload(subgroup_size=150, policy=policy),
                 implementation=dos_jax.Implementation(program='gpu'))
  p, state, text = train(dos_jax.adamw(lr, weight_decay=0.1, mask=mask, **options))
  assert 'dos_jax_adamw_host_leaves' in text
  one_p, one_state, _ = train(dos_jax.adamw(lr, weight_decay=0.1, mask=mask, **options),
                              sharded=False)
  ref_p, _, _ = train(optax.adamw(lr, weight_decay=0.1, mask=mask), jnp.float32, sharded=False)
  for key in params:
    got = np.asarray(p[key], np.float32)
    if isinstance(policy, dos_jax.AllHost):
      np.testing.assert_array_equal(got, np.asarray(one_p[key], np.float32))
    want = np.asarray(ref_p[key].astype(dtype), np.float32)
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # as in test_sharded_state_runs_the_native_kernel_per_shard
      np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=4 * 1e-2 * 2 ** -8)
    assert p[key].sharding.is_equivalent_to(shardings[key], p[key].ndim), key
  for got, want in zip(state.host, one_state.host):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert state.host and all(x.sharding.spec == P(None, None, 'data') and
                            x.sharding.memory_kind == 'pinned_host' for x in state.host)
