"""The GPU program's shape, proven on a CPU machine: the step lowered for 'cuda'.

No timing: the lowered StableHLO's def-use graph (`dos_jax.dataflow`) shows what XLA may
run at once. The host update must sit in a host region, the device stream must run the
Pallas kernel, neither may use a value of the other within a step, and host-bound
gradients must be able to leave the device before the backward pass ends.
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
from dos_jax.kernels import host_adamw_rows

from tests.test_adamw import random_grads
from tests.test_adamw import random_tree

POLICIES = [dos_jax.AllHost(), dos_jax.Stride(2), dos_jax.DeviceFraction(0.4)]


def _update_graph(policy, dtype, seed: int, impl=dos_jax.UpdateImpl.KERNEL) -> Graph:
  params = jax.device_put(random_tree(seed, dtype), jax.devices()[0])  # committed
  opt = dos_jax.adamw(1e-3, weight_decay=0.1,
                      offload=dos_jax.Offload(subgroup_size=23, policy=policy),
                      implementation=dos_jax.Implementation(program='gpu', host=impl,
                                                            device=impl))
  state = opt.init(params)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  return Graph.from_lowered(lower_for_gpu(step, params, state, random_grads(params, 0, seed),
                                          donate_argnums=(0, 1)))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('policy', POLICIES, ids=repr)
def test_host_region_and_device_stream_are_independent(policy, dtype, seed):
  graph = _update_graph(policy, dtype, seed)
  host = graph.with_kind(OpKind.HOST_REGION)
  stream = graph.with_kind(OpKind.PALLAS)
  assert host, 'the host update runs in a host region'
  if host_adamw_rows.rows_kernel_available():
    # The native kernel runs only inside host regions.
    assert graph.with_kind(OpKind.HOST_KERNEL)
    assert all(OpKind.HOST_REGION in n.kinds for n in graph.with_kind(OpKind.HOST_KERNEL))
  if isinstance(policy, dos_jax.AllHost):
    assert not stream
    return
  assert stream, 'the device stream runs the Pallas kernel'
  assert not set(n.index for n in host) & set(n.index for n in stream)
  for h in host:
    for d in stream:
      assert not graph.depends(h, d), f'host region #{h.index} uses the device stream'
      assert not graph.depends(d, h), f'device stream #{d.index} uses the host region'


@pytest.mark.parametrize('policy', POLICIES[1:], ids=repr)
def test_xla_paths_are_independent_too(policy, seed):
  """optax's own ops on both paths: the streamed rows' fetch, update and write-back (in
  the stream lanes' calls, or a loop) use no value of a host region, nor it of them."""
  graph = _update_graph(policy, jnp.bfloat16, seed, impl=dos_jax.UpdateImpl.XLA)
  host = graph.with_kind(OpKind.HOST_REGION)
  loops = [n for n in graph.nodes if n.name in ('stablehlo.while', 'func.call')
           and OpKind.TO_DEVICE in n.kinds and OpKind.HOST_REGION not in n.kinds]
  assert host and loops
  for h in host:
    for d in loops:
      assert not graph.depends(h, d) and not graph.depends(d, h)


def _mlp(num_layers: int, width: int, in_dim: int, dtype, seed: int):
  rng = np.random.default_rng(seed)
  params = {}
  for i in range(num_layers):
    fan_in = in_dim if i == 0 else width
    params[f'layer{i}'] = {
        'w': jnp.asarray(rng.standard_normal((fan_in, width)) / np.sqrt(fan_in), dtype),
        'b': jnp.zeros((width,), dtype)}
  return params


def _loss(params, x):
  h = x
  for i in range(len(params)):
    layer = params[f'layer{i}']
    h = jnp.tanh(h @ layer['w'] + layer['b'])
  return jnp.mean(h.astype(jnp.float32) ** 2)


@pytest.mark.parametrize('clip', [False, True], ids=['no_clip', 'clip'])
def test_host_bound_gradients_leave_before_the_backward_pass_ends(clip, seed):
  """An L-layer bf16 MLP, one subgroup per layer, AllHost, one jitted step: at least
  L - 1 copies of gradient data to host memory do not depend on the first layer's
  weight gradient (`x^T . dh`, the last matmul of the backward pass)."""
  num_layers, width, in_dim = 6, 32, 24
  params = _mlp(num_layers, width, in_dim, jnp.bfloat16, seed)
  x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((8, in_dim)), jnp.bfloat16)
  offload = dos_jax.Offload(subgroup_size=width * width + width, policy=dos_jax.AllHost())
  opt = dos_jax.adamw(1e-3, offload=offload, implementation=dos_jax.Implementation(program='gpu'))
  if clip:
    opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), opt)
  state = opt.init(params)
  inner = state[-1] if clip else state
  assert inner.layout.num_subgroups == num_layers

  def step(p, s, x):
    loss, g = jax.value_and_grad(_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  graph = Graph.from_lowered(lower_for_gpu(step, params, state, x, donate_argnums=(0, 1)))
  first_w = {f'tensor<{in_dim}x{width}xbf16>', f'tensor<{width}x{in_dim}xbf16>',
             f'tensor<{in_dim}x{width}xf32>', f'tensor<{width}x{in_dim}xf32>'}
  last_matmuls = [n for n in graph.with_kind(OpKind.DOT)
                  if n.name == 'stablehlo.dot_general' and set(n.result_types) & first_w]
  assert len(last_matmuls) == 1, [n.result_types for n in graph.with_kind(OpKind.DOT)]
  grad_copies = [n for n in graph.nodes if n.kinds == {OpKind.TO_HOST}
                 and any(OpKind.DOT in a.kinds for a in graph.ancestors(n))]
  early = [n for n in grad_copies if not graph.depends(n, last_matmuls[0])]
  assert len(early) >= num_layers - 1, (len(early), len(grad_copies))
