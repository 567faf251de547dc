"""The sharded two-memory program (ZeRO-1 on a data x tensor mesh) for a GPU, seen
without one: the host tier runs the native host AdamW per data shard, inside host
regions, and XLA's host loop is gone from the program.

Lowered for 'cuda' on 4 virtual CPU devices (`dataflow.lower_for_gpu`), and compiled for
4 H100s, one SPMD partition each, with the CUDA plugin's compile-only client (the
`compiled_gpu` tests, skipped where no plugin is installed). The numbers of the same
program, run on the CPU backend, are checked against optax in tests/test_sharding.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dos_jax
from dos_jax import dataflow
from tests.tooling.graph import Graph
from dos_jax.dataflow import hlo
from tests.tooling.ops import OpKind
from tests.tooling.ops import _custom_call_target
from tests.tooling.ops import _frontend
from tests.tooling.ops import _nested_ops
from dos_jax.kernels import host_adamw_rows
from dos_jax.geometry.partition import Tier

from tests.test_adamw import random_grads

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 4, reason='needs 4 (virtual) devices'),
    pytest.mark.skipif(not host_adamw_rows.rows_kernel_available(),
                       reason=host_adamw_rows.rows_kernel_unavailable_reason() or 'no kernel'),
]

_NATIVE = 'dos_jax_adamw_host_leaves'
_DATA = 2  # the mesh's data axis: the host state's shards
CASES = [(dos_jax.AllHost(), jnp.float32), (dos_jax.AllHost(), jnp.bfloat16),
         (dos_jax.Stride(2), jnp.float32), (dos_jax.Stride(2), jnp.bfloat16)]
IDS = ['AllHost-fp32', 'AllHost-bf16', 'Stride-fp32', 'Stride-bf16']


def _lowered_step(policy, dtype, seed, impl=dos_jax.UpdateImpl.KERNEL):
  """The step on a data=2 x tensor=2 mesh, lowered for 'cuda'; (lowered, state)."""
  rng = np.random.default_rng(seed)
  params = {'w1': jnp.asarray(rng.standard_normal((16, 24)), dtype),
            'w2': jnp.asarray(rng.standard_normal((24, 16)), dtype),
            'b': jnp.asarray(rng.standard_normal((24,)), dtype)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(_DATA, 2), ('data', 'tensor'))
  specs = {'w1': P(None, 'tensor'), 'w2': P('tensor', None), 'b': P('tensor')}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  opt = dos_jax.adamw(1e-3, weight_decay=0.1,
                      offload=dos_jax.Offload(subgroup_size=150, policy=policy),
                      implementation=dos_jax.Implementation(program='gpu', host=impl))
  p = jax.device_put(params, shardings)
  state = opt.init(p)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  grads = jax.device_put(random_grads(params, 0, seed), shardings)
  return dataflow.lower_for_gpu(step, p, state, grads, donate_argnums=(0, 1)), state


def _host_ops(module):
  """Every op of the module that runs in a host region."""
  return [op for f in module.body.operations for op in _nested_ops(f.operation)
          if _frontend(op, '_xla_compute_type') == 'host']


def _host_blocks(state):
  """(rows, K, S) of each host block of the state."""
  return [x.shape for x in state.host]


@pytest.mark.parametrize('policy, dtype', CASES, ids=IDS)
def test_lowered_host_region_runs_the_native_kernel_per_data_shard(policy, dtype, seed):
  lowered, state = _lowered_step(policy, dtype, seed)
  graph = Graph.from_lowered(lowered)
  kernels = graph.with_kind(OpKind.HOST_KERNEL)
  assert kernels and all(OpKind.HOST_REGION in n.kinds for n in kernels)
  host_ops = _host_ops(lowered.compiler_ir('stablehlo'))
  assert not [op for op in host_ops if op.name == 'stablehlo.while'], "XLA's host loop"
  calls = [op for op in host_ops if op.name == 'stablehlo.custom_call'
           and _custom_call_target(op) == _NATIVE]
  # One call per host block, on its data shard: (R, K, S / data) rows of state.
  blocks = _host_blocks(state)
  assert sorted(tuple(op.operands[0].type.shape) for op in calls) == sorted(
      (r, k, s // _DATA) for r, k, s in blocks)
  stream = graph.with_kind(OpKind.PALLAS)
  assert bool(stream) == (not isinstance(policy, dos_jax.AllHost))
  for h in graph.with_kind(OpKind.HOST_REGION):
    for d in stream:
      assert graph.independent(h, d), (h, d)


def test_lowered_gradient_rows_leave_before_the_backward_pass_ends(seed):
  """An L-layer bf16 MLP, weights sharded over 'tensor', one subgroup per layer, AllHost
  with clipping: each subgroup's gradient row goes to host memory on its own, and L - 1
  of the L rows do not depend on the first layer's weight gradient (the backward pass's
  last matmul), so not on the clip's global norm either, which needs every gradient."""
  from tests.test_gpu_program import _loss  # pylint: disable=import-outside-toplevel
  from tests.test_gpu_program import _mlp  # pylint: disable=import-outside-toplevel
  num_layers, width, in_dim = 6, 32, 24
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(_DATA, 2), ('data', 'tensor'))
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
      mesh, P(None, 'tensor') if x.ndim == 2 else P('tensor'))),
                        _mlp(num_layers, width, in_dim, jnp.bfloat16, seed))
  x = jax.device_put(jnp.asarray(np.random.default_rng(seed).standard_normal((8, in_dim)),
                                 jnp.bfloat16), NamedSharding(mesh, P('data', None)))
  size = width * width + width
  offload = dos_jax.Offload(subgroup_size=size, policy=dos_jax.AllHost())
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0),
                      dos_jax.adamw(1e-3, offload=offload,
                                    implementation=dos_jax.Implementation(program='gpu')))
  state = opt.init(params)
  assert state[-1].layout.num_subgroups == num_layers

  def step(p, s, x):
    loss, g = jax.value_and_grad(_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  graph = Graph.from_lowered(dataflow.lower_for_gpu(step, params, state, x,
                                                    donate_argnums=(0, 1)))
  assert graph.with_kind(OpKind.HOST_KERNEL)
  first_w = {f'tensor<{in_dim}x{width}xbf16>', f'tensor<{width}x{in_dim}xbf16>'}
  last_matmuls = [n for n in graph.with_kind(OpKind.DOT)
                  if n.name == 'stablehlo.dot_general' and set(n.result_types) & first_w]
  assert len(last_matmuls) == 1
  rows = [n for n in graph.nodes if n.kinds == {OpKind.TO_HOST}
          and n.result_types == (f'tensor<1x{size}xbf16>',)]
  assert len(rows) == num_layers
  early = [n for n in rows if not graph.depends(n, last_matmuls[0])]
  assert len(early) == num_layers - 1


def test_lowered_xla_host_loop_is_still_there_when_asked_for(seed):
  lowered, _ = _lowered_step(dos_jax.Stride(2), jnp.bfloat16, seed, dos_jax.UpdateImpl.XLA)
  host_ops = _host_ops(lowered.compiler_ir('stablehlo'))
  assert 'stablehlo.while' in [op.name for op in host_ops]
  assert not [op for op in host_ops if op.name == 'stablehlo.custom_call'
              and _custom_call_target(op) == _NATIVE]


_COMPILER, _WHY = dataflow.gpu_compiler_available()


@pytest.mark.compiled_gpu
@pytest.mark.skipif(not _COMPILER, reason=f'no GPU compiler here: {_WHY}')
@pytest.mark.skipif(jax.default_backend() != 'cpu',
                    reason='deviceless compiles run with JAX_PLATFORMS=cpu')
@pytest.mark.parametrize('policy, dtype', CASES, ids=IDS)
def test_compiled_for_four_gpus_runs_the_native_kernel_per_data_shard(policy, dtype, seed):
  """Compiled for 4 H100s (one SPMD partition each): every host call's computation is
  the native kernel on its partition's shard of the host state, with no loop."""
  assert dataflow.compile.prepare(), 'the native kernel is registered in the plugin'
  lowered, state = _lowered_step(policy, dtype, seed)
  program = dataflow.compile_lowered(lowered, native_host_kernel=True)
  assert 'num_partitions=4' in program.hlo_text.split('\n', 1)[0]
  module = hlo.Module.parse(program.hlo_text)
  host = [c for c in module.computations.values() if c.execution_thread == 'host']
  instructions = [i for c in host for i in c.instructions]
  assert not [i for i in instructions if i.opcode == 'while'], "XLA's host loop"
  calls = [i for i in instructions if i.opcode == 'custom-call'
           and i.attribute('custom_call_target') == f'"{_NATIVE}"']
  blocks = _host_blocks(state)
  assert sorted(i.arrays[0].dims for i in calls) == sorted(
      (r, k, s // _DATA) for r, k, s in blocks)
  assert len(program.schedule.host_calls) == len(state.partition.blocks(Tier.HOST))
