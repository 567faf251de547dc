"""`dos_jax.step.device_stream`: a function staged out as one call for a GPU stream of its own,
in a scheduling group with the host call (the device tiers' stream lanes).

On the CPU the call is a call: the region's results are the function's, and the
two-memory program's step with the device tiers on their stream is the step without,
bit for bit (against optax too, in test_per_subgroup.py, where it is on by default).
Its lowering is checked here; where the GPU compiler places it, in
test_compiled_family.py."""

import contextlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax.geometry.partition import Tier
from dos_jax.step import device_stream
from dos_jax.step import lanes as lanes_lib
from tests.test_adamw import decay_mask
from tests.test_adamw import random_grads
from tests.test_adamw import random_tree


def _ops_with(text: str, attribute: str) -> list[str]:
  return [line.strip() for line in text.splitlines() if attribute in line]


def test_the_region_returns_what_the_function_does(seed):
  rng = np.random.default_rng(seed)
  a, b, c = (jnp.asarray(rng.standard_normal((3, 5)), jnp.float32) for _ in range(3))

  def fn(x, pair):  # closes over `c`, returns a pytree
    return {'sum': x + pair[0], 'prod': pair[1] * c}, x.sum()

  region = device_stream.on_stream(fn, device_stream.next_group())
  want = fn(a, (b, c))
  for got in (region(a, (b, c)), jax.jit(region)(a, (b, c))):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_only_the_call_carries_the_stream_and_the_group():
  """One call returning one tuple, with the stream, the group and no inlining; the
  get-tuple-elements that unpack it carry nothing (else XLA would make each of them a
  stream pair of its own)."""
  group = device_stream.next_group()
  region = device_stream.on_stream(lambda x, y: (x + y, x * y), group)
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  text = jax.jit(region).trace(x, x).lower(lowering_platforms=('cuda',)).as_text()
  annotated = _ops_with(text, '_xla_stream_annotation')
  assert len(annotated) == 1, annotated
  call = annotated[0]
  assert call.split(' = ')[1].startswith('call @'), call
  assert f'_scheduling_group_id = "{group}"' in call and 'inlineable = "false"' in call
  assert '-> tuple<' in call, call
  assert len(_ops_with(text, 'stablehlo.get_tuple_element')) == 2


def test_a_region_with_effects_is_refused():
  # (Distinct group ids within one program: test_group_ids_are_numbered_per_traced_program.)
  def effectful(x):
    jax.debug.print('{}', x)
    return x

  with pytest.raises(ValueError, match='cannot have effects'):
    jax.jit(device_stream.on_stream(effectful, 1))(jnp.ones(2))


def _lower_for_cuda(opt, params, state, grads) -> str:
  return jax.jit(_step(opt)).trace(params, state, grads).lower(
      lowering_platforms=('cuda',)).as_text()


def test_group_ids_are_numbered_per_traced_program(seed):
  """The same step traced and lowered twice in one process is the same program text:
  scheduling-group ids count from the same start in every trace (`next_group`), so a
  retrace finds the persistent compilation cache. Two groups of one program differ."""
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  grads = random_grads(params, 0, seed)
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(0.5), dos_jax.adamw(
      3e-2, weight_decay=0.05, mask=decay_mask,
      offload=dos_jax.Offload(subgroup_size=23, policy=dos_jax.Stride(2)),
      implementation=dos_jax.Implementation(
          program='gpu', device=dos_jax.UpdateImpl.XLA)))  # no Pallas: no GPU here
  state = opt.init(params)
  first = _lower_for_cuda(opt, params, state, grads)
  device_stream.next_group()  # a group asked for between two traces changes nothing
  assert '_scheduling_group_id' in first
  # XLA's device update runs in stream regions in the lowering that groups one host call
  # (the staged one keeps it out of regions: it holds constants).
  staged = lowering_lib.of_version() is lowering_lib.Lowering.STAGED
  assert ('dos_jax_stream_region' in first) is not staged
  assert _lower_for_cuda(opt, params, state, grads) == first

  def two_groups(x):
    return [device_stream.on_stream(lambda x: x + 1, device_stream.next_group())(x)
            for _ in range(2)]

  text = jax.jit(two_groups).trace(jnp.ones(3)).lower(lowering_platforms=('cuda',)).as_text()
  assert len(set(re.findall(r'_scheduling_group_id = "(\d+)"', text))) == 2, text


@pytest.mark.skipif(lowering_lib.of_version() is not lowering_lib.Lowering.IN_REGION,
                    reason="the staged lowering keeps XLA's update out of stream regions; "
                    'its lanes are read in the compiled program (tests/test_compiled_*)')
@pytest.mark.parametrize('traced_with, flags, jitted_with, expected', [
    (None, '', None, 2), (3, '', None, 3), (None, '3', None, 3), (1, '3', None, 1),
    (None, '', 3, 3), (None, '3', 2, 2), (2, '', 3, 3)])
def test_the_group_holds_one_lane_fewer_than_the_async_limit(traced_with, flags, jitted_with,
                                                              expected, seed, monkeypatch):
  """The step runs as many stream lanes as the host call's scheduling group holds,
  `limit - 1` of Stride(2)'s two (`lanes.grouped_lanes`), one at least: the limit of
  the options `dos_jax.jit` compiles the step with, else of those an enclosing
  `dos_jax.compiled_with` names (`traced_with`: a caller that compiles the lowered step
  itself), else the one `XLA_FLAGS` sets, else XLA's 2. Every lane is named as the
  group's (`LANES_ATTRIBUTE`)."""
  monkeypatch.setenv('XLA_FLAGS', f'--xla_gpu_experimental_parallel_async_compute_limit={flags}'
                     if flags else '--xla_force_host_platform_device_count=8')
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  grads = random_grads(params, 0, seed)
  opt = dos_jax.adamw(3e-2, offload=dos_jax.Offload(subgroup_size=23, policy=dos_jax.Stride(2)),
                      implementation=dos_jax.Implementation(program='gpu',
                                                            device=dos_jax.UpdateImpl.XLA))
  state = opt.init(params)
  told = contextlib.nullcontext() if traced_with is None else dos_jax.compiled_with(
      {'xla_gpu_experimental_parallel_async_compute_limit': traced_with})
  with told:
    if jitted_with is None:
      text = _lower_for_cuda(opt, params, state, grads)
    else:  # lowered only: the CPU backend would refuse XLA:GPU options at compile time
      options = {'xla_gpu_enable_latency_hiding_scheduler': True,
                 'xla_gpu_experimental_parallel_async_compute_limit': jitted_with}
      text = dos_jax.jit(_step(opt), compiler_options=options).trace(
          params, state, grads).lower(lowering_platforms=('cuda',)).as_text()
  streams = _ops_with(text, '_xla_stream_annotation')
  lanes = max(1, min(2, expected - 1))  # Stride(2)'s two buffers, as the group allows
  assert len(streams) == lanes, streams
  grouped = [op for op in streams if '_scheduling_group_id' in op]
  assert len(grouped) == min(lanes, expected - 1), streams
  assert all(device_stream.LANES_ATTRIBUTE in op for op in streams), streams


def _pair(policy=None, two_streams: bool = True):
  """The two-memory program's clipped AdamW; `two_streams` False: without stream
  regions (the device tiers left to XLA's scheduler)."""
  offload = dos_jax.Offload(subgroup_size=23, policy=policy or dos_jax.Stride(2))
  return dos_jax.chain(dos_jax.clip_by_global_norm(0.5), dos_jax.adamw(
      3e-2, weight_decay=0.05, mask=decay_mask, offload=offload,
      implementation=dos_jax.Implementation(program='gpu', two_streams=two_streams)))


def _lanes(monkeypatch, count: int) -> None:
  """Every step traced from now on runs `count` stream lanes (0: the library's choice)."""
  if count:
    monkeypatch.setattr(lanes_lib, 'lane_count',
                        lambda plan, rows, lanes=0, limit=None: max(1, min(lanes or count, rows)))


def _step(opt):
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


def _regions(opt, params, state, grads) -> int:
  """How many stream regions the step traces."""
  jaxpr = jax.make_jaxpr(_step(opt))(params, state, grads)
  return str(jaxpr).count('dos_jax_stream_region[')


def _streams(opt, params, state, grads) -> int:
  """How many GPU streams the step's regions run on: its lanes (one region per lane,
  or, in the staged lowering, per lane and stage)."""
  jaxpr = str(jax.make_jaxpr(_step(opt))(params, state, grads))
  return len(set(re.findall(r"'_xla_stream_annotation', '(\d+)'", jaxpr)))


def _uses_stream(opt, params, state, grads) -> bool:
  return _regions(opt, params, state, grads) > 0


@pytest.mark.parametrize('policy', [
    dos_jax.Stride(2), dos_jax.ResidentFraction(0.3, then=dos_jax.Stride(3))], ids=repr)
@pytest.mark.parametrize('lanes', [-1, 1, 3])
def test_the_step_on_two_streams_is_the_step_without_bit_for_bit(policy, lanes, seed,
                                                                 monkeypatch):
  """The two-memory program (run on the CPU backend), clipping that fires: 4 steps with
  the device tiers on their streams in the library's lanes (2), against the same step
  without stream regions (`Implementation(two_streams=False)`, lanes -1), in one
  region, or in 3 lanes."""
  params = jax.device_put(random_tree(seed), jax.devices()[0])

  def run(two_streams=True):
    opt = _pair(policy=policy, two_streams=two_streams)
    p, s = params, opt.init(params)
    regions = _regions(opt, p, s, random_grads(p, 0, seed))
    step = jax.jit(_step(opt))
    for i in range(4):
      p, s = step(p, s, jax.tree.map(lambda g: 3 * g, random_grads(p, i, seed)))
    return regions, (p, s)

  regions, ours = run()
  assert regions > 0
  with monkeypatch.context() as patch:
    _lanes(patch, max(lanes, 0))
    other_regions, theirs = run(two_streams=lanes >= 0)
  assert (other_regions > 0) is (lanes >= 0), other_regions
  for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(ours)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('lanes, regions', [(0, 1), (1, 1), (2, 2), (3, 3), (50, 0)])
def test_streamed_rows_go_round_robin_over_the_lanes(lanes, regions, seed, monkeypatch):
  """One GPU stream per lane (0: the library's, one where the step is traced for
  XLA's default limit of 2 asynchronous calls in flight), at most one per streamed row
  (`regions` 0: as many as the plan streams)."""
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  _lanes(monkeypatch, lanes)
  opt = _pair()
  state = opt.init(params)
  streamed = len(state[1].partition.ids(Tier.STREAMED))
  assert streamed >= 4, streamed
  assert _streams(opt, params, state, random_grads(params, 0, seed)) == (regions or streamed)
  # Lane k holds the k-th, (k + lanes)-th, ... block of the stream.
  part = state[1].partition
  plan = types.SimpleNamespace(streamed=part.stream, buffers=2)
  lane_rows = [ids for lane in lanes_lib.stream_lanes(plan, part, lanes)
               for tier, ids in lane if tier is Tier.STREAMED]
  first_row = {ids[0]: b for b, ids in enumerate(part.blocks(Tier.STREAMED))}
  position = {first_row[g]: p for p, g in enumerate(part.stream)}
  assert sorted(b for ids in lane_rows for b in ids) == sorted(position)
  assert all(position[b] % len(lane_rows) == k for k, ids in enumerate(lane_rows) for b in ids)


def test_it_applies_with_host_and_device_tiers(seed):
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  grads = random_grads(params, 0, seed)

  def uses(**kwargs):
    opt = _pair(**kwargs)
    return _uses_stream(opt, params, opt.init(params), grads)

  assert uses()
  assert not uses(policy=dos_jax.AllHost())  # nothing to run beside the host call
  assert not uses(policy=dos_jax.AllDevice())


def test_the_step_without_stream_regions_says_why(seed):
  """`Implementation(two_streams=False)`: the construction's reason names the choice,
  and the step traces no stream region."""
  from dos_jax.step import construction  # pylint: disable=import-outside-toplevel
  from dos_jax.step.options import StepOptions  # pylint: disable=import-outside-toplevel
  params = jax.device_put(random_tree(seed), jax.devices()[0])
  opt = _pair(two_streams=False)
  state = opt.init(params)
  part, layout = state[1].partition, state[1].layout
  off = dos_jax.Offload(subgroup_size=23, policy=dos_jax.Stride(2))
  for two_streams in (True, False):
    options = StepOptions.of(off, dos_jax.Implementation(two_streams=two_streams))
    built = construction.resolve(part, layout, None, options, native=True)
    assert built.two_streams is two_streams
  assert built.explain().splitlines()[0] == (
      'two streams: no (asked for, Implementation(two_streams=False))')
  assert _regions(opt, params, state, random_grads(params, 0, seed)) == 0
