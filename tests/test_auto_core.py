"""Auto driving the real offloaded AdamW: same math as optax, one compile per plan."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dos_jax
from dos_jax.geometry import layout as layout_lib
from dos_jax.planner import costmodel
from dos_jax.planner.auto import Auto
from dos_jax.planner.costmodel import HardwareProfile


def test_auto_plans_the_core_and_replans_with_one_compile_per_plan(seed):
  rng = np.random.default_rng(seed)
  params = {
      'w': jnp.asarray(rng.standard_normal((37, 29)), jnp.float32),
      'b': jnp.asarray(rng.standard_normal((53,)), jnp.float32),
  }
  profile = HardwareProfile(
      name='synthetic', h2d_gbps=10.0, d2h_gbps=10.0, both_gbps=8.0,
      host_adamw_gparams_by_threads={2: 1.0}, device_adamw_gparams=20.0, device_free_bytes=1e9,
  )
  slow_host = profile.scaled(host=0.2)
  policy = Auto(profile, patience=2, warmup=0)
  tx = dos_jax.adamw(1e-2, offload=dos_jax.Offload(subgroup_size=256, policy=policy))
  ref = optax.adamw(1e-2)
  state, ref_state = tx.init(params), ref.init(params)
  spec = layout_lib.spec_for(params, 256)
  assert policy.plan(spec).streamed and policy.plan(spec).host  # a genuine split

  traces = []

  @functools.partial(jax.jit, static_argnames='plan')
  def step(p, s, g, plan):
    traces.append(plan)
    u, s = tx.update(g, s, p, plan=plan)
    return optax.apply_updates(p, u), s

  p, ref_p = params, params
  plans = []
  for i in range(8):
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    plan = policy.current
    plans.append(plan)
    p, state = step(p, state, g, plan)
    u, ref_state = ref.update(g, ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    # Steps 0-3 run as believed; then the host turns 5x slower (another job took it).
    machine = profile if i < 4 else slow_host
    policy.observe(plan, costmodel.predict(machine, spec, plan).update_seconds)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert policy.replans == 1 and len(set(plans)) == 2
  assert len(plans[-1].streamed) > len(plans[0].streamed)  # work moved off the slow host
  assert len(traces) == len(set(plans))  # each distinct plan compiled exactly once
