"""The host tier in early host calls (`Partition.early`, `dos_jax.step.early_calls`) on
the CPU backend (the two-memory program's numbers; Pallas in interpret mode), stored per
subgroup, fp32 and bf16 params. A test picks the early calls of a state with
`dos_jax.migrate(state, plan, early=...)` (`_with_early`).

Under `dos_jax.clip_by_global_norm` the early calls speculate on a clip factor of 1 and
are redone when it is not: the step must equal the unspeculated one (no early call)
bit for bit, on steps where the clip fires, where it does not, and on steps with a NaN
gradient (alone, and under `optax.apply_if_finite`, which skips them). The gradients of
each step are scaled so that the clip fires on chosen steps (`FIRES`). Against optax the
suite's tolerance holds (tests/test_adamw.py).

Seeds: the `seed` fixture (tests/conftest.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax.geometry import partition as partition_lib
from dos_jax.geometry.partition import Tier
from dos_jax.step import early_calls
from dos_jax.step import kernel_calls
from tests.test_adamw import SCHEDULE
from tests.test_adamw import decay_mask
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

MAX_NORM = 1.0
FIRES = (1, 2, 5)  # steps whose gradients are scaled past MAX_NORM (norm ~17 vs ~0.2)


def _in_place_everywhere(in_place, with_result):
  """`kernel_calls.state_in_place` choosing the GPU program's form on every platform."""
  del with_result
  return in_place


def _opt(clip: bool = True, policy=dos_jax.Stride(2)):
  adamw = dos_jax.adamw(learning_rate=SCHEDULE, weight_decay=0.05, mask=decay_mask,
                        offload=dos_jax.Offload(subgroup_size=23, policy=policy),
                        implementation=dos_jax.Implementation(program='gpu'))
  return dos_jax.chain(dos_jax.clip_by_global_norm(MAX_NORM), adamw) if clip else adamw


def _offloaded(state) -> dos_jax.OffloadedState:
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  return next(x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x))


def _with_early(state, early):
  """`state` with its host tier in `early` host calls: an int K, K calls of near-equal
  size (0 or 1: one call after the backward pass, nothing speculates), or a tuple of
  early call sizes (`Partition.early`)."""
  part = _offloaded(state).partition
  if isinstance(early, int):
    early = tuple(len(c) for c in partition_lib.host_calls(range(len(part.host)), early)[:-1])
  moved = dos_jax.migrate(state, part.plan, early=early)
  assert _offloaded(moved).partition.early == early
  return moved


def _host_calls(text: str) -> int:
  """The native host kernel's calls in a lowered step (speculated, plain and redo)."""
  return text.count('dos_jax_adamw_host_leaves')


def _grads(params, t, seed, nan_at):
  scale = 1.0 if t in FIRES else 0.01
  grads = jax.tree.map(lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype),
                       random_grads(params, t, seed))
  if t in nan_at:
    grads['w'] = grads['w'].at[1, 2, 3].set(jnp.nan)
  return grads


def _run(opt, params, seed, steps, nan_at=(), lowered=None, placed=False, early=None):
  """`steps` jitted steps, the state donated as a train step does; the lowered step's
  text goes to `lowered` (a list) if given. `placed`: the params are already where
  they should be (else on the first device). `early`: the state's early host calls
  (`_with_early`; None: those `init` chose)."""
  if not placed:
    params = jax.device_put(params, jax.devices()[0])
  state = opt.init(params)
  if early is not None:
    state = _with_early(state, early)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(1,))
  for t in range(steps):
    grads = _grads(params, t, seed, nan_at)
    if lowered is not None and t == 0:
      lowered.append(step.lower(params, state, grads).as_text())
    params, state = step(params, state, grads)
  return params, state


def _assert_identical(want, got, message):
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=message)



@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_speculated_steps_are_the_unspeculated_steps_bit_for_bit(dtype, seed):
  params = random_tree(seed, jnp.dtype(dtype))
  one = []
  want = _run(_opt(), params, seed, steps=7, early=0, lowered=one)
  for early in (2, 3, 7):
    texts = []
    got = _run(_opt(), params, seed, steps=7, early=early, lowered=texts)
    # The early path was built: each early block is redone in a host call of its own
    # (on the CPU backend), so the step has one more host call per early block.
    state = _with_early(_opt().init(jax.device_put(params, jax.devices()[0])), early)
    early_blocks = sum(_offloaded(state).partition.early)
    assert early_blocks > 0 and _host_calls(texts[0]) == _host_calls(one[0]) + early_blocks, (
        early, early_blocks, _host_calls(texts[0]), _host_calls(one[0]))
    _assert_identical(want, got, f'seed {seed}, early calls {early}, clip fires at {FIRES}')


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_accelerator_form_speculates_in_place_and_redoes(dtype, seed, monkeypatch):
  """The GPU program's form (the early kernels update the donated state in its buffer
  and keep an undo; the redo kernel puts it back and updates again in place, its out
  rows a result that crosses to the device only on a rollback), run on the CPU backend:
  bit for bit the unspeculated step, clip firing or not."""
  params = random_tree(seed, jnp.dtype(dtype))
  want = _run(_opt(), params, seed, steps=7, early=0)
  monkeypatch.setattr(kernel_calls, 'state_in_place', _in_place_everywhere)
  texts = []
  got = _run(_opt(), params, seed, steps=7, lowered=texts, early=3)
  assert 'dos_jax_adamw_host_leaves_state_arg_undo' in texts[0]
  assert 'dos_jax_adamw_host_leaves_redo' in texts[0]
  _assert_identical(want, got, f'seed {seed}, clip fires at {FIRES}')


def test_params_on_a_one_device_mesh_take_the_unsharded_step(seed):
  """The runner puts a one-device run's params on a one-device mesh (a `NamedSharding`
  with the state's axis). Such a mesh splits nothing: the step is the one built for
  plain arrays, its early calls included (as many host kernel calls in the lowered
  step), bit for bit over 7 steps with the clip firing on some."""
  params = random_tree(seed)
  plain_text, mesh_text = [], []
  want = _run(_opt(), params, seed, steps=7, lowered=plain_text, early=3)
  mesh = jax.sharding.Mesh(jax.devices()[:1], ('data',))
  on_mesh = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  got = _run(_opt(), on_mesh, seed, steps=7, lowered=mesh_text, placed=True, early=3)
  assert got[1][-1].sharded is not None  # the state kept the mesh
  calls = [_host_calls(t) for t in (plain_text[0], mesh_text[0])]
  assert calls[0] == calls[1] > 0, calls
  _assert_identical(want, got, f'seed {seed}, clip fires at {FIRES}')


def test_each_early_block_is_redone_on_the_cpu_backend(seed):
  """On a CPU backend the speculated blocks are updated again, from the state before
  the step, in a kernel call of their own: one more call per early block."""
  params = random_tree(seed)
  counts = []
  for early in (0, 3):
    texts = []
    _run(_opt(), params, seed, steps=1, lowered=texts, early=early)
    counts.append(_host_calls(texts[0]))
  state = _opt().init(jax.device_put(params, jax.devices()[0]))[-1]
  blocks = len(state.partition.blocks(Tier.HOST))
  early_blocks = blocks - len(np.array_split(np.arange(blocks), 3)[-1])
  assert counts[1] == counts[0] + early_blocks, (counts, blocks)


def test_a_nan_step_is_the_unspeculated_nan_step(seed):
  params = random_tree(seed)
  want = _run(_opt(), params, seed, steps=4, nan_at=(2,), early=0)
  got = _run(_opt(), params, seed, steps=4, nan_at=(2,), early=3)
  assert np.isnan(np.asarray(jax.tree.leaves(got[0])[0])).any(), f'seed {seed}'
  _assert_identical(want, got, f'seed {seed}, NaN at step 2')


def test_apply_if_finite_skips_a_nan_step_as_unspeculated(seed):
  params = random_tree(seed)
  make = lambda: optax.apply_if_finite(_opt(), 5)
  want = _run(make(), params, seed, steps=5, nan_at=(1, 3), early=0)
  got = _run(make(), params, seed, steps=5, nan_at=(1, 3), early=3)
  assert np.isfinite(np.asarray(jax.tree.leaves(got[0])[0])).all(), f'seed {seed}'
  _assert_identical(want, got, f'seed {seed}, NaN at steps 1 and 3')


def test_early_calls_without_clipping_are_the_one_call_step(seed):
  params = random_tree(seed, jnp.bfloat16)
  want = _run(_opt(clip=False), params, seed, steps=4, early=0)
  got = _run(_opt(clip=False), params, seed, steps=4, early=3)
  _assert_identical(want, got, f'seed {seed}')


def test_early_calls_under_clipping_match_optax(seed):
  params = random_tree(seed)
  got, _ = _run(_opt(), params, seed, steps=7, early=3)
  ref = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(
      learning_rate=SCHEDULE, weight_decay=0.05, mask=decay_mask))
  want, _ = _run(ref, params, seed, steps=7)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7,
                               err_msg=f'seed {seed}')


def test_host_call_order_follows_the_backward_pass():
  plan = dos_jax.Plan(streamed=(0, 2, 4, 6), host=(1, 3, 5, 7))
  part = partition_lib.for_plan(plan, two_memories=True)
  blocks = part.blocks(Tier.HOST)
  assert [blocks[b] for b in early_calls.host_blocks(part)] == [(7,), (5,), (3,), (1,)]
  # The blocks without weight decay (the norm scales, complete at the end of the
  # backward pass) come last.
  assert [blocks[b] for b in early_calls.host_blocks(part, decayed_rows=6)] == [
      (5,), (3,), (1,), (7,)]


def test_the_redo_flag_is_the_clip_factor_not_one():
  scalars = dos_jax.kernels.AdamWScalars(
      lr=1.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, bc1=0.1, bc2=0.1)
  assert early_calls.redo_flag(scalars) is None  # no clip: nothing speculates
  for factor, want in ((1.0, False), (0.5, True), (0.0, True), (np.nan, True)):
    flag = early_calls.redo_flag(
        scalars.__class__(**{**scalars.__dict__, 'grad_scale': jnp.float32(factor)}))
    assert bool(flag) is want, factor



@dataclasses.dataclass(frozen=True)
class _Chooses(dos_jax.Stride):
  """Stride(2) that asks for early calls of 1 and 2 subgroups, as `dos_jax.Auto` would."""

  def early_calls(self, spec, plan):
    del spec
    return (1, 2) if len(plan.host) > 3 else ()


def test_init_takes_the_policys_early_calls(seed, monkeypatch):
  params = random_tree(seed)
  want = _run(_opt(), params, seed, steps=3, early=0)
  monkeypatch.setattr(kernel_calls, 'state_in_place', _in_place_everywhere)
  texts = []
  opt = _opt(policy=_Chooses(2))
  assert _offloaded(opt.init(jax.device_put(params, jax.devices()[0]))).partition.early == (1, 2)
  got = _run(opt, params, seed, steps=3, lowered=texts)
  # Three early blocks (1 + 2), each redone in place.
  assert texts[0].count('dos_jax_adamw_host_leaves_redo') == 3, seed
  _assert_identical(want[1][-1].host, got[1][-1].host, f'seed {seed}')


def test_the_undo_and_redo_kernels_against_the_plain_kernel(seed):
  """The native kernels alone (jit, state donated): `keep_undo` updates in place and
  keeps what it overwrote; the redo on the same buffer with the flag set puts it back
  and updates again, equal to the plain kernel's update of the old state with the
  redo's scalars; with the flag clear it leaves the state as the speculated call left
  it. The copy is the kernel library's, found by the state buffer: a redo with no
  speculated call before it on that buffer fails in one line."""
  from dos_jax.kernels import AdamWScalars  # pylint: disable=import-outside-toplevel
  from dos_jax.kernels import host_adamw_rows  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  groups, size = 3, 1000
  state = rng.standard_normal((groups, 3, size)).astype(np.float32)
  state[:, 2] = np.abs(state[:, 2])
  grads = [jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (700, 1500)]
  kw = dict(offsets=(0, 1000), slots=(0, 1, 2), decayed_rows=3)
  rows = jnp.arange(groups, dtype=jnp.int32)
  scalars = lambda f: AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                                   weight_decay=1e-4, bc1=0.1, bc2=0.001, grad_scale=f)

  @jax.jit
  def plain(s, factor):
    return host_adamw_rows.adamw_host_leaves(s, grads, None, rows, scalars(factor),
                                             lowp_dtype=jnp.bfloat16, **kw)

  @functools.partial(jax.jit, donate_argnums=0)
  def speculate(s):
    out = host_adamw_rows.adamw_host_leaves(
        s, grads, None, rows, scalars(1.0), lowp_dtype=jnp.bfloat16, state_in_arg=True,
        keep_undo=True, **kw)
    return jax.lax.optimization_barrier((s, out))

  @functools.partial(jax.jit, donate_argnums=0)
  def redo(s, flag):
    again = host_adamw_rows.adamw_host_leaves_redo(
        s, grads, None, rows, scalars(0.5), redo=flag, lowp_dtype=jnp.bfloat16, **kw)
    return jax.lax.optimization_barrier((s, again))

  covered = np.zeros((groups, size), bool)
  covered.reshape(-1)[:700] = covered.reshape(-1)[1000:2500] = True
  want_spec, want_spec_out = (np.asarray(x) for x in plain(jnp.asarray(state), 1.0))
  want_redo, want_redo_out = (np.asarray(x) for x in plain(jnp.asarray(state), 0.5))
  s, out = speculate(jnp.asarray(state))
  np.testing.assert_array_equal(np.asarray(s), want_spec, err_msg=f'seed {seed}')
  np.testing.assert_array_equal(np.asarray(out)[covered], want_spec_out[covered])
  kept, _ = redo(s, jnp.int32(0))
  np.testing.assert_array_equal(np.asarray(kept), want_spec, err_msg=f'seed {seed}')
  # Twice over: the second speculated call reuses the copy the first redo handed back.
  for _ in range(2):
    s, _ = speculate(jnp.asarray(state))
    again_state, again = redo(s, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(again_state), want_redo, err_msg=f'seed {seed}')
    np.testing.assert_array_equal(np.asarray(again)[covered], want_redo_out[covered])
  with pytest.raises(Exception, match='no undo copy is kept for this state'):
    jax.block_until_ready(redo(jnp.asarray(state), jnp.int32(1)))


def test_inits_pool_check_counts_the_undo(seed):
  """The two-memory program may speculate (early host calls): its pinned bytes hold an
  undo of every host subgroup's state but the last's; the one-memory program's do not."""
  from dos_jax import pinned_pool  # pylint: disable=import-outside-toplevel
  params = random_tree(seed)
  offload = dos_jax.Offload(subgroup_size=23, policy=dos_jax.AllHost())
  host = len(offload.policy.plan(dos_jax.geometry.layout.spec_for(params, 23)).host)
  extra = (host - 1) * 23 * 8  # fp32 params: mu and nu, 8 B per element
  program = lambda name: dos_jax.Implementation(program=name)
  assert pinned_pool.state_pinned_bytes(params, offload, implementation=program('gpu')) == (
      pinned_pool.state_pinned_bytes(params, offload, implementation=program('cpu')) + extra)
