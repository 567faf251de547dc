"""One construction, no knobs (issue 40): the README's optimizer, `Offload(policy=Stride(2))`
with nothing else set, on the two-memory program (`Implementation(program='gpu')`), builds
its one construction: its state stored per subgroup, early host calls by the fixed rule
(`partition.early_host_calls`), several host calls in the program lowered for 'cuda',
and optax's numbers; and the same step lowered twice in one process is one program.

Seeds: the `seed` fixture (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from tests.tooling.graph import Graph
from dos_jax.dataflow import lower_for_gpu
from tests.tooling.ops import OpKind
from dos_jax.geometry import partition as partition_lib

LAYERS = 6
MAX_NORM = 1.0


def _readme_optimizer(**offload):
  """The README's optimizer: clipping chained with dos_jax's AdamW, `Stride(2)` on the
  two-memory program and, unless given, every other `Offload` field at its default."""
  adamw = dos_jax.adamw(1e-3, weight_decay=0.1,
                        offload=dos_jax.Offload(policy=dos_jax.Stride(2), **offload),
                        implementation=dos_jax.Implementation(program='gpu'))
  return dos_jax.chain(dos_jax.clip_by_global_norm(MAX_NORM), adamw)


def _step(opt):
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


def _host_kernel_calls(text: str) -> int:
  """The native host kernel's calls in a lowered step, one per host block and call."""
  return text.count('dos_jax_adamw_host_leaves')


def _readme_mlp_abstract():
  """A 6-layer bf16 MLP whose layers are the default subgroup size (1e8 elements: one
  subgroup per layer), abstract (nothing is allocated), and its abstract state."""
  width = 10_000
  assert width * width == dos_jax.Offload().subgroup_size
  params = {f'layer{i}': {'w': jax.ShapeDtypeStruct((width, width), jnp.bfloat16)}
            for i in range(LAYERS)}
  opt = _readme_optimizer()
  return opt, params, dos_jax.abstract_state(opt, params)


def test_the_readme_optimizer_is_per_subgroup_with_the_rules_early_calls():
  """Nothing set but the policy and the program: the state is stored per subgroup and
  its early host calls are the fixed rule's (three host subgroups: three calls)."""
  _, _, state = _readme_mlp_abstract()
  part = state[-1].partition
  assert state[-1].layout.num_subgroups == LAYERS
  assert part.two_memories
  assert all(len(ids) == 1 for t in partition_lib.TIERS for ids in part.blocks(t))
  assert len(part.host) == LAYERS // 2
  assert part.early and part.early == partition_lib.early_host_calls(len(part.host)), part


def test_the_step_lowered_for_cuda_has_several_host_calls(seed):
  """The same optimizer on a small 6-layer MLP, one subgroup per layer (the subgroup
  size is the user's own choice, not a construction's), lowered for 'cuda': each host
  call is a host region of its own, one per early call and the last."""
  width = 16
  params = jax.device_put(_mlp(seed, width), jax.devices()[0])
  opt = _readme_optimizer(subgroup_size=width * width)
  state = opt.init(params)
  part = state[-1].partition
  assert part.early == partition_lib.early_host_calls(LAYERS // 2) != ()
  lowered = lower_for_gpu(_step(opt), params, state, params, donate_argnums=(0, 1))
  calls = len(part.early) + 1
  assert _host_kernel_calls(lowered.as_text()) >= calls > 1, (
      _host_kernel_calls(lowered.as_text()), part.early)
  regions = Graph.from_lowered(lowered).with_kind(OpKind.HOST_REGION)
  assert len(regions) >= calls, (len(regions), part.early)


@pytest.mark.xfail(strict=True, raises=(TypeError, ValueError), reason=(
    'an abstract state with early host calls does not lower: jax traces a '
    'ShapeDtypeStruct in pinned_host as a device-memory value (jax 0.10.2 and 0.11.2 '
    "with jax-cuda13-plugin: early_calls' switch branches differ, TypeError; 0.12.0.1: "
    "an `add` of a host and a device operand, ValueError)"))
def test_the_readme_optimizers_abstract_step_lowers_for_cuda():
  """The default-size step above, abstract (as `gpu_program` builds it over several
  devices), lowered for 'cuda': more than one host region."""
  opt, params, state = _readme_mlp_abstract()
  lowered = lower_for_gpu(_step(opt), params, state, params, donate_argnums=(0, 1))
  assert len(Graph.from_lowered(lowered).with_kind(OpKind.HOST_REGION)) > 1


def _mlp(seed: int, width: int = 16):
  rng = np.random.default_rng(seed)
  return {f'layer{i}': {'w': jnp.asarray(rng.standard_normal((width, width)) / width,
                                         jnp.float32)}
          for i in range(LAYERS)}


def _grads(params, t: int, seed: int):
  """Random gradients; on odd steps large enough for the clip to fire."""
  keys = jax.random.split(jax.random.key(seed % (1 << 31) + t), LAYERS)
  scale = 10.0 if t % 2 else 0.01
  return {name: {'w': scale * jax.random.normal(k, layer['w'].shape, jnp.float32)}
          for k, (name, layer) in zip(keys, params.items())}


def test_the_one_construction_matches_optax(seed):
  """The same optimizer on a small 6-layer MLP, one subgroup per layer (the subgroup
  size is the user's own choice, not a construction's), against
  `optax.chain(clip_by_global_norm, adamw)` over 5 steps, the clip firing on some: the
  tolerance of the suite's optax comparisons (tests/test_adamw.py)."""
  width = 16
  params = jax.device_put(_mlp(seed, width), jax.devices()[0])
  opt = _readme_optimizer(subgroup_size=width * width)
  ref = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(1e-3, weight_decay=0.1))
  state, ref_state = opt.init(params), ref.init(params)
  part = state[-1].partition
  assert part.two_memories and len(part.host) == LAYERS // 2
  assert part.early == partition_lib.early_host_calls(LAYERS // 2) != ()
  step, ref_step = jax.jit(_step(opt), donate_argnums=(1,)), jax.jit(_step(ref))
  ref_params = params
  for t in range(5):
    grads = _grads(params, t, seed)
    params, state = step(params, state, grads)
    ref_params, ref_state = ref_step(ref_params, ref_state, grads)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                               err_msg=f'seed {seed}')


def test_lowering_the_same_step_twice_gives_the_same_program(seed):
  """`update` is pure: the same step traced and lowered (for the CPU) twice in one
  process is the same program text, its scheduling-group ids included."""
  width = 16
  params = jax.device_put(_mlp(seed, width), jax.devices()[0])
  opt = _readme_optimizer(subgroup_size=width * width)
  state = opt.init(params)
  assert state[-1].partition.early  # host calls in a scheduling group
  grads = _grads(params, 1, seed)
  texts = [jax.jit(_step(opt)).trace(params, state, grads).lower(
      lowering_platforms=('cpu',)).as_text() for _ in range(2)]
  assert texts[0] == texts[1]
