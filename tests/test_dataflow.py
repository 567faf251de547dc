"""`dos_jax.dataflow` on small programs lowered for 'cuda' whose graphs are known.

Each program is lowered without a GPU (`lower_for_gpu`); the tests check what the walker
finds in it: host regions, Pallas kernels, transfers and dots, attributed to the right
top-level op, and which top-level ops depend on which.
"""

import jax
from jax import lax
from jax.experimental import compute_on as compute_on_lib
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
import jax.numpy as jnp
import pytest

from dos_jax import dataflow
from tests.tooling.graph import Graph
from tests.tooling.graph import Node
from tests.tooling.ops import OpKind

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
ROWS, WIDTH = 4, 128
KERNEL = 'dos_jax_adamw'

# jax 0.10: the function form is `compute_on2`; 0.11 renamed it `compute_on` (same
# signature) and dropped `compute_on2`.
_compute_on = getattr(compute_on_lib, 'compute_on2', None) or compute_on_lib.compute_on


def host_region(fn, out_space=HOST):
  return _compute_on(fn, compute_type='device_host', out_memory_spaces=out_space)


def on_host(shape, dtype=jnp.float32):
  """An argument that lives in pinned host memory (a small concrete array: an abstract
  one with a pinned_host sharding traces as device memory)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind='pinned_host')
  return jax.device_put(jnp.zeros(shape, dtype), sharding)


def on_device(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _double_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + 1.0


def pallas_double(x, name=KERNEL):
  """A Triton Pallas kernel on a small power-of-two array."""
  return pl.pallas_call(
      _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=name,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1))(x)


def device_rows(rows_on_host):
  """The device stream: each row copied to the device, run through the kernel there,
  and copied back into the host-resident carry."""

  def body(i, carry):
    row = jax.device_put(lax.dynamic_index_in_dim(carry, i, keepdims=False), DEVICE)
    row = pallas_double(row)
    return lax.dynamic_update_index_in_dim(carry, jax.device_put(row, HOST), i, 0)

  return lax.fori_loop(0, ROWS, body, rows_on_host)


def host_update(state):
  """The host stream: a loop of its own, in a host region."""
  return host_region(lambda s: lax.fori_loop(0, 3, lambda i, t: t * 0.9 + 1.0, s))(state)


def _the_loop(graph: Graph) -> Node:
  loops = [n for n in graph.nodes if n.name == 'stablehlo.while']
  assert len(loops) == 1, loops
  return loops[0]


def _one(nodes):
  assert len(nodes) == 1, nodes
  return nodes[0]


# ----------------------------------------------------------------------------------
# Host region and device stream.


def test_host_region_and_device_loop_are_independent():

  def step(host_state, rows):
    return host_update(host_state), device_rows(rows)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_host((ROWS, WIDTH)), on_host((ROWS, WIDTH))))
  host = _one(graph.host_regions())
  loop = _the_loop(graph)
  assert host.name == 'func.call' and host.own_kinds == {OpKind.HOST_REGION}
  # The host region's own loop is inside its callee, not a top-level while.
  assert loop is not host and OpKind.HOST_REGION not in loop.kinds
  assert {OpKind.PALLAS, OpKind.TO_HOST, OpKind.TO_DEVICE} <= loop.kinds
  assert graph.kernel_calls(KERNEL) == [loop]
  assert not graph.depends(host, loop) and not graph.depends(loop, host)
  assert graph.independent(host, loop)
  assert host not in graph.ancestors(loop) and loop not in graph.descendants(host)


def test_host_region_consuming_the_device_loop_depends_on_it():

  def step(host_state, rows):
    out = device_rows(rows)
    return host_update(host_state + out), out

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_host((ROWS, WIDTH)), on_host((ROWS, WIDTH))))
  host = _one(graph.host_regions())
  loop = _the_loop(graph)
  assert graph.depends(host, loop)
  assert not graph.depends(loop, host)
  assert not graph.independent(host, loop)
  assert loop in graph.ancestors(host) and host in graph.descendants(loop)


def test_pallas_kernel_beside_host_region_is_independent():
  """The device computation as one top-level kernel call, the host region on host data
  placed inside the step."""

  def step(state, x):
    return host_update(jax.device_put(state, HOST)), pallas_double(x)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_device((WIDTH,)), on_device((8, WIDTH))))
  host = _one(graph.host_regions())
  kernel = _one(graph.kernel_calls())
  assert kernel.name == 'stablehlo.custom_call' and kernel.own_kinds == {OpKind.PALLAS}
  assert kernel.kernel_names == (KERNEL,)
  assert graph.kernel_calls('some_other_kernel') == []
  assert graph.independent(host, kernel)
  # The host region reads the placed state: it depends on that transfer only.
  placed = _one(graph.transfers_to_host())
  assert graph.depends(host, placed.node) and not graph.depends(kernel, placed.node)


# ----------------------------------------------------------------------------------
# Transfers and dots.


def test_transfer_of_a_product_depends_on_the_dot_and_an_unrelated_one_does_not():
  n, k, m = 16, 32, 64

  def step(x, w, unrelated):
    y = jnp.tanh(x @ w)
    return jax.device_put(y, HOST), jax.device_put(unrelated * 2, HOST)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_device((n, k), jnp.bfloat16), on_device((k, m), jnp.bfloat16),
      on_device((7, 3))))
  dot = _one(graph.nodes_containing(OpKind.DOT))
  assert dot.name == 'stablehlo.dot_general'
  (lhs, rhs, result), = [(d.lhs, d.rhs, d.result) for d in dot.dots]
  assert (lhs.shape, rhs.shape, result.shape) == ((n, k), (k, m), (n, m))
  assert result.dtype == 'bfloat16'
  transfers = graph.transfers_to_host()
  assert len(transfers) == 2
  by_shape = {t.type.shape: t for t in transfers}
  product, other = by_shape[(n, m)], by_shape[(7, 3)]
  assert product.type.dtype == 'bfloat16' and product.type.nbytes == n * m * 2
  assert other.type.dtype == 'float32' and other.type.nbytes == 7 * 3 * 4
  assert product.to == 'host' and product.placement == 'pinned_host'
  assert product.source == 'device' and product.moves
  assert graph.depends(product.node, dot)
  assert not graph.depends(other.node, dot)
  assert dot in graph.ancestors(product.node) and dot not in graph.ancestors(other.node)
  assert graph.transfers_to_device() == []


def test_host_region_outputs_are_annotated_and_those_annotations_move_nothing():
  """JAX wraps each host-region output in `annotate_device_placement`: to pinned_host
  for a host output (already there: no transfer), to device for a device output."""

  def step(state):
    return (host_region(lambda s: s + 1.0)(state),
            host_region(lambda s: s * 3.0, out_space=DEVICE)(state))

  graph = Graph.from_lowered(dataflow.lower_for_gpu(step, on_host((WIDTH,))))
  first, second = graph.host_regions()
  assert graph.transfers_to_host() == []
  noop = _one(graph.transfers_to_host(include_noops=True))
  assert noop.source == 'host' and not noop.moves
  assert graph.operands(noop.node) == [first]
  upload = _one(graph.transfers_to_device())
  assert upload.source == 'host' and upload.moves and upload.placement == 'device'
  assert graph.operands(upload.node) == [second]


def test_transfer_of_a_host_argument_moves_nothing():

  def step(state, x):
    return jax.device_put(state, HOST), jax.device_put(x, HOST)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(step, on_host((8,)), on_device((8,))))
  assert len(graph.transfers_to_host(include_noops=True)) == 2
  moved = _one(graph.transfers_to_host())
  assert moved.source == 'device' and moved.node.operand_types[0].shape == (8,)


@jax.jit
def _private_to_host(x):
  return jax.device_put(x, HOST) * 2.0


def test_memory_spaces_follow_loops_calls_and_host_regions():

  def step(state, rows, x):
    looped = device_rows(rows)  # a host-resident carry stays on the host
    called = _private_to_host(x)  # placed on the host inside a called function
    branch = lax.cond(x[0] > 0, lambda: x, lambda: -x)
    return (host_update(state), jax.device_put(looped, HOST),
            jax.device_put(called, HOST), jax.device_put(x * 2, HOST),
            jax.device_put(branch, HOST))

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_host((WIDTH,)), on_host((ROWS, WIDTH)), on_device((8,))))
  loop = _the_loop(graph)
  call = _one([n for n in graph.nodes if n.name == 'func.call' and not n.own_kinds])
  branch = _one([n for n in graph.nodes if n.name in ('stablehlo.case', 'stablehlo.if')])
  assert graph.memory_space(_one(graph.host_regions())) == 'host'
  # fori_loop's while carries (counter, index, rows): the counters are device scalars.
  assert [graph.memory_space(loop, k) for k in range(3)] == ['device', 'device', 'host']
  assert graph.memory_space(call) == 'host'
  assert graph.memory_space(branch) is None
  every = graph.transfers_to_host(include_noops=True)
  moved = graph.transfers_to_host()
  # Annotations of the host region's output, the loop's and the call's move nothing;
  # x * 2 moves, and the branch's result may (unknown source).
  assert {t.source for t in every if not t.moves} == {'host'}
  assert len(every) - len(moved) == 3
  assert sorted((t.source or '?') for t in moved) == ['?', 'device']


# ----------------------------------------------------------------------------------
# Attribution of nested ops.


@jax.jit
def _private_matmul(a, b):
  """Jitted inside a jitted step: outlined as `func.func private` and `func.call`ed."""
  return jnp.sin(a) @ b


@jax.jit
def _private_kernel(x):
  return pallas_double(x)


def test_ops_in_a_loop_body_and_a_called_function_belong_to_the_top_level_op():

  def step(x, a, b):
    # The kernel two calls deep inside the loop body: while -> closed_call -> kernel fn.
    looped = lax.fori_loop(0, 3, lambda i, c: _private_kernel(c), x)
    return looped, _private_matmul(a, b)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_device((8, WIDTH)), on_device((8, 16)), on_device((16, 32))))
  # Only the loop and the call are top level; the kernel and the dot are inside them.
  assert [n for n in graph.nodes if n.name == 'stablehlo.custom_call'] == []
  assert [n for n in graph.nodes if n.name == 'stablehlo.dot_general'] == []
  loop = _the_loop(graph)
  assert _one(graph.kernel_calls(KERNEL)) is loop
  assert loop.kernel_names == (KERNEL,) and OpKind.PALLAS not in loop.own_kinds
  call = _one(graph.nodes_containing(OpKind.DOT))
  assert call.name == 'func.call' and call.callee and call.own_kinds == frozenset()
  dot = _one(call.dots)
  assert (dot.lhs.shape, dot.rhs.shape, dot.result.shape) == ((8, 16), (16, 32), (8, 32))
  assert _one(graph.dots()) == (call, dot)
  assert graph.independent(loop, call)


def test_a_loop_inside_a_host_region_is_part_of_it():

  def step(state, x):
    return host_update(state), x @ x

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_host((WIDTH,)), on_device((8, 8))))
  assert [n for n in graph.nodes if n.name == 'stablehlo.while'] == []
  host = _one(graph.nodes_containing(OpKind.HOST_REGION))
  assert host == _one(graph.host_regions())
  assert OpKind.DOT not in host.kinds


def test_values_read_inside_a_branch_are_dependencies():
  """`stablehlo.case` branches read outer values directly, not through operands: a
  walker that looks only at a top-level op's operands misses the edge."""

  def step(i, x, w):
    y = x @ w
    z = lax.switch(i, [lambda: jnp.sin(y), lambda: jnp.cos(y)])
    return jax.device_put(z, HOST)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_device((), jnp.int32), on_device((8, 8)), on_device((8, 8))))
  case = _one([n for n in graph.nodes if n.name == 'stablehlo.case'])
  dot = _one(graph.nodes_containing(OpKind.DOT))
  assert dot is not case
  # The case op's only operand is the branch index; the product is read inside.
  assert [str(v.type) for v in case.op.operands] == ['tensor<i32>']
  assert graph.depends(case, dot)
  transfer = _one(graph.transfers_to_host())
  assert graph.depends(transfer.node, case) and graph.depends(transfer.node, dot)


# ----------------------------------------------------------------------------------
# Graph bookkeeping and other kernels.


def test_ancestors_descendants_and_depends_agree():

  def step(host_state, rows, x, w):
    out = device_rows(rows)
    return host_update(host_state + out), jax.device_put(x @ w, HOST)

  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      step, on_host((ROWS, WIDTH)), on_host((ROWS, WIDTH)), on_device((8, 8)),
      on_device((8, 8))))
  assert [n.index for n in graph] == list(range(len(graph)))
  for node in graph:
    ancestors = graph.ancestors(node)
    assert all(a.index < node.index for a in ancestors)
    assert set(graph.operands(node)) <= set(ancestors)
    for other in graph:
      assert graph.depends(node, other) == (other in ancestors)
      assert graph.depends(node, other) == (node in graph.descendants(other))
  # Every op feeds the function's return.
  assert graph.nodes[-1].name == 'func.return'
  assert len(graph.ancestors(graph.nodes[-1])) == len(graph) - 1


def test_lower_for_gpu_lowers_for_cuda_and_passes_jit_arguments():
  lowered = dataflow.lower_for_gpu(lambda x, y: (pallas_double(x), y + 1),
                                   on_device((8, WIDTH)), on_device((4,)),
                                   donate_argnums=(1,))
  text = lowered.as_text()
  assert 'xla.gpu.triton' in text
  assert 'tf.aliasing_output' in text or 'jax.buffer_donor' in text
  assert _one(Graph.from_lowered(lowered).kernel_calls()).kernel_names == (KERNEL,)
  # An ir.Module works as well as a Lowered.
  assert len(Graph(lowered.compiler_ir('stablehlo'))) == len(Graph.from_lowered(lowered))


@pytest.mark.xfail(
    jax.__version_info__ >= (0, 11) and jax.default_backend() != 'gpu', strict=True,
    raises=AssertionError,
    reason='jax >= 0.11 registers the Mosaic GPU lowering rule '
    '(jax._src.pallas.mosaic_gpu.pallas_call_registration) when a CUDA backend starts, '
    "which a deviceless run never does: pallas_call's gpu_lowering asserts `rule is not "
    "None` (0.11.2 and 0.12.0.1 with jax-cuda13-plugin, JAX_PLATFORMS=cpu)")
def test_mosaic_gpu_kernel_is_a_pallas_kernel():
  mosaic_gpu = pytest.importorskip('jax.experimental.pallas.mosaic_gpu')

  def step(x):
    return pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=mosaic_gpu.CompilerParams())(x)

  lowered = dataflow.lower_for_gpu(step, on_device((128, WIDTH)))
  graph = Graph.from_lowered(lowered)
  kernel = _one(graph.kernel_calls())
  assert kernel.own_kinds == {OpKind.PALLAS} and kernel.kernel_names == ('',)


def test_missing_entry_function_is_an_error():
  lowered = dataflow.lower_for_gpu(lambda x: x + 1, on_device((4,)))
  with pytest.raises(ValueError, match='no function @nope'):
    Graph(lowered.compiler_ir('stablehlo'), entry='nope')


def test_tensor_types():
  graph = Graph.from_lowered(dataflow.lower_for_gpu(
      lambda a, b, c: (a.astype(jnp.bfloat16), b > 0, c + 1),
      on_device((3, 5)), on_device((2,), jnp.int32), on_device((4,), jnp.uint8)))
  types = {t.dtype: t for n in graph for t in n.results}
  assert types['bfloat16'].shape == (3, 5) and types['bfloat16'].nbytes == 30
  assert types['bfloat16'].element_type == 'bf16'
  assert types['bfloat16'].text == 'tensor<3x5xbf16>'
  assert types['bool'].nbytes == 2
  assert types['uint8'].nbytes == 4
  for name in ('bfloat16', 'bool', 'uint8'):
    assert jnp.dtype(name).name == name
