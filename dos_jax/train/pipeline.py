"""Pipeline parallelism over the `pipeline` mesh axis: a GPipe schedule in one program.

The model's blocks are split evenly into S stages of n = n_layers / S consecutive
blocks. In the pipelined params tree every block leaf is stacked to (S, n, ...) and its
first axis is sharded over `pipeline`, so stage s holds blocks s*n .. s*n+n-1 and no
other stage does. The embedding, final norm and head (a small part of a transformer) are
computed around the pipeline on every stage.

The schedule (GPipe): the batch is cut into M microbatches; under `jax.shard_map`, manual
over `pipeline` only (`data` and `tensor` stay automatic, so tensor parallelism inside
a block is unchanged), every stage runs its n blocks (a `lax.scan` over the stacked
layer axis) once per tick for T = M + S - 1 ticks. At tick t stage 0 takes microbatch t,
every other stage takes what its predecessor made at tick t-1 (`lax.ppermute` to the
next stage), and the last stage's output at tick t is microbatch t-S+1. Stages idle in
S-1 of the T ticks: the bubble, (S-1)/(M+S-1) of the time. The backward pass is JAX's
transpose of the same program (ppermute's transpose sends the cotangents back one
stage), so gradients need no schedule of their own, and each stage's gradients come out
on that stage's devices.

Microbatch m takes rows m, m+M, m+2M, ... of the batch, so that when each data shard's
rows divide by M every microbatch stays split over `data` exactly like the batch.

Params exist in three forms here: canonical (`model.init_params`, `blocks/<i>/...`: what
checkpoints hold, so a checkpoint does not depend on the pipeline shape), pipelined
(`stages/...` stacked, one tree on the whole mesh: what the forward pass takes), and per
stage (`stage_tree`: what stage s's optimizer updates).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dos_jax.planner.stages import bubble_fraction
from dos_jax.train import model as model_lib
from dos_jax.train import sharding as sharding_lib
from dos_jax.train.configlib import ConfigError

PIPELINE = sharding_lib.PIPELINE
STAGES = 'stages'  # Key of the stacked blocks in the pipelined tree.
_FIRST_KEYS = ('embedding',)  # Owned (updated) by the first stage.
_LAST_KEYS = ('final_norm', 'head')  # Owned by the last stage.


@dataclasses.dataclass(frozen=True)
class Shape:
  """The pipeline: S stages of n blocks each, M microbatches per batch."""

  stages: int
  layers_per_stage: int
  microbatches: int

  @property
  def n_layers(self) -> int:
    return self.stages * self.layers_per_stage

  @property
  def bubble_fraction(self) -> float:
    """Idle share of a GPipe step: (S-1)/(M+S-1)."""
    return bubble_fraction(self.stages, self.microbatches)


def make_shape(n_layers: int, stages: int, microbatches: int) -> Shape:
  """Checks that the layers split evenly over the stages.

  Raises:
    ConfigError: naming mesh.pipeline and model.n_layers when they do not divide.
  """
  if n_layers % stages:
    raise ConfigError(
        f'mesh.pipeline: {stages} stages do not split model.n_layers={n_layers} evenly')
  return Shape(stages, n_layers // stages, microbatches)


def check_batch(shape: Shape, batch_size: int, data: int) -> None:
  """Every microbatch must split evenly over the data axis.

  Raises:
    ConfigError: naming train.microbatches and data.batch_size.
  """
  if batch_size % (shape.microbatches * data):
    raise ConfigError(
        f'train.microbatches: data.batch_size={batch_size} does not split into'
        f' {shape.microbatches} microbatches x mesh.data={data}')


# ---- The schedule -------------------------------------------------------------------


def _varying(x: jax.Array) -> jax.Array:
  """Marks a value as differing across stages (shard_map's type of a stage's state)."""
  if hasattr(jax.lax, 'pcast'):
    return jax.lax.pcast(x, PIPELINE, to='varying')
  return jax.lax.pvary(x, PIPELINE)  # Older JAX spelling.


def _to_microbatches(x_BxLxD: jax.Array, m: int) -> jax.Array:
  b = x_BxLxD.shape[0]
  return jnp.swapaxes(x_BxLxD.reshape(b // m, m, *x_BxLxD.shape[1:]), 0, 1)


def _from_microbatches(x_MxbxLxD: jax.Array) -> jax.Array:
  m, b = x_MxbxLxD.shape[:2]
  return jnp.swapaxes(x_MxbxLxD, 0, 1).reshape(m * b, *x_MxbxLxD.shape[2:])


def _gpipe(block: Callable, shape: Shape, dtype, stage_params: Any, x32_MxbxLxD: jax.Array,
           sin_LxK2: jax.Array, cos_LxK2: jax.Array) -> jax.Array:
  """One stage's view of the schedule (runs under shard_map, manual over `pipeline`):
  its blocks' params (1, n, ...), every microbatch's input; returns every microbatch's
  output of the last stage, on every stage.

  The inputs and outputs cross the shard_map boundary in float32 (exact for bf16
  values): the sums over `pipeline` there (the output's, and the input cotangent's in
  the backward pass) crash XLA:CPU's compiler in bfloat16 ("Invalid binary instruction
  opcode copy", jax 0.10.2).
  """
  s_count, m_count = shape.stages, shape.microbatches
  stage = jax.lax.axis_index(PIPELINE)
  params = jax.tree.map(lambda a: a[0], stage_params)
  is_first, is_last = stage == 0, stage == s_count - 1
  forward = [(i, (i + 1) % s_count) for i in range(s_count)]

  def run_blocks(h):
    return jax.lax.scan(lambda h, p: (block(p, h, sin_LxK2, cos_LxK2), None), h, params)[0]

  def tick(carry, t):
    received, outputs = carry
    fresh = jax.lax.dynamic_index_in_dim(x32_MxbxLxD, jnp.minimum(t, m_count - 1), 0, False)
    # Made stage-varying in float32, so the backward pass's sum of its cotangent over
    # the stages is a float32 one.
    fresh = _varying(fresh).astype(dtype)
    out = run_blocks(jnp.where(is_first, fresh, received))
    done = t - (s_count - 1)  # The microbatch the last stage finishes at tick t.
    slot = jnp.clip(done, 0, m_count - 1)
    kept = jax.lax.dynamic_index_in_dim(outputs, slot, 0, False)
    value = jnp.where(is_last & (done >= 0), out, kept)
    outputs = jax.lax.dynamic_update_index_in_dim(outputs, value, slot, 0)
    return (jax.lax.ppermute(out, PIPELINE, forward), outputs), None

  zeros = jnp.zeros(x32_MxbxLxD.shape, dtype)
  init = (_varying(zeros[0]), _varying(zeros))
  ticks = jnp.arange(m_count + s_count - 1)
  _, outputs = jax.lax.scan(tick, init, ticks)[0]
  # Only the last stage holds the outputs; the sum hands them to every stage.
  outputs = jnp.where(is_last, outputs, jnp.zeros_like(outputs)).astype(jnp.float32)
  return jax.lax.psum(outputs, PIPELINE)


def make_apply(cfg: model_lib.ModelConfig, mesh: Mesh, shape: Shape) -> model_lib.ApplyFn:
  """The pipelined forward `apply(pipelined_params, tokens_BxL) -> logits_BxLxV`: the
  same function as `model.make_apply(cfg)` of the canonical params."""
  parts = model_lib.make_parts(cfg)
  dtype = cfg.compute_jnp_dtype
  body = lambda p, x, sin, cos: _gpipe(parts.block, shape, dtype, p, x, sin, cos)
  run = jax.shard_map(
      body, mesh=mesh, in_specs=(P(PIPELINE), P(), P(), P()), out_specs=P(),
      axis_names=frozenset({PIPELINE}),
  )

  def apply(params, tokens_BxL):
    sin_LxK2, cos_LxK2 = parts.rotary(tokens_BxL.shape[1])
    x_BxLxD = parts.embed(params['embedding'], tokens_BxL)
    x_MxbxLxD = _to_microbatches(x_BxLxD, shape.microbatches)
    y_MxbxLxD = run(params[STAGES], x_MxbxLxD.astype(jnp.float32), sin_LxK2, cos_LxK2)
    return parts.head(params, _from_microbatches(y_MxbxLxD).astype(dtype))

  return apply


# ---- Params: canonical <-> pipelined <-> per stage ----------------------------------


def _block_names(shape: Shape) -> list[str]:
  return [model_lib.block_name(i, shape.n_layers) for i in range(shape.n_layers)]


def to_pipelined(canonical: Any, shape: Shape) -> Any:
  """Canonical params (any placement) -> the pipelined tree as host numpy arrays."""
  names = _block_names(shape)
  blocks = [jax.tree.map(np.asarray, canonical['blocks'][name]) for name in names]
  n = shape.layers_per_stage

  def stack(*leaves):
    return np.stack(leaves).reshape(shape.stages, n, *leaves[0].shape)

  out = {k: np.asarray(v) if k != 'final_norm' else jax.tree.map(np.asarray, v)
         for k, v in canonical.items() if k != 'blocks'}
  out[STAGES] = jax.tree.map(stack, *blocks)
  return out


def pipelined_specs(params: Any, rules=sharding_lib.ShardingRules.megatron()) -> Any:
  """PartitionSpecs of the pipelined tree: the model's table, with the stacked blocks'
  two leading axes (stage, layer) over `pipeline` and unsplit."""
  specs = {}
  for key, value in params.items():
    if key == STAGES:
      inner = sharding_lib.param_specs(
          jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), value), rules)
      specs[key] = jax.tree.map(lambda s: P(PIPELINE, None, *s), inner,
                                is_leaf=lambda x: isinstance(x, P))
    else:
      specs[key] = sharding_lib.param_specs({key: value}, rules)[key]
  return specs


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
  """The devices of one stage, as a (data, tensor) mesh."""
  axes = [a for a in mesh.axis_names if a != PIPELINE]
  devices = np.take(mesh.devices, stage, axis=mesh.axis_names.index(PIPELINE))
  return Mesh(devices, tuple(axes))


def owned_keys(stage: int, stages: int) -> tuple[str, ...]:
  """The pipelined tree's top-level keys stage `stage` updates."""
  keys = (STAGES,)
  if stage == 0:
    keys += _FIRST_KEYS
  if stage == stages - 1:
    keys += _LAST_KEYS
  return keys


def _drop_pipeline(spec: P) -> P:
  return P(*(None if a == PIPELINE else a for a in spec))


def stage_shardings(mesh: Mesh, stage: int, stages: int, specs: Any) -> Any:
  """NamedShardings of stage `stage`'s own tree, on its stage mesh."""
  sub = stage_mesh(mesh, stage)
  return {k: jax.tree.map(lambda s: NamedSharding(sub, _drop_pipeline(s)), specs[k],
                          is_leaf=lambda x: isinstance(x, P))
          for k in owned_keys(stage, stages)}


def _view(array: jax.Array, sharding: NamedSharding, stage_index: int | None) -> jax.Array:
  """The part of a whole-mesh array on `sharding`'s devices, as an array of that
  sharding, without a copy: stage `stage_index`'s slab of a stacked leaf, or (None) the
  stage's copy of a leaf replicated over `pipeline`."""
  devices = set(sharding.device_set)
  shards = [s.data for s in array.addressable_shards if s.device in devices]
  shape = array.shape if stage_index is None else (1, *array.shape[1:])
  return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def stage_view(params: Any, stage: int, shardings: Any) -> Any:
  """Stage `stage`'s own part of a pipelined tree (params or gradients), on its devices,
  sharing their buffers."""
  out = {}
  for key, target in shardings.items():
    index = stage if key == STAGES else None
    out[key] = jax.tree.map(lambda a, s, i=index: _view(a, s, i), params[key], target)
  return out


def assemble(stage_trees: list[Any], mesh: Mesh, specs: Any) -> Any:
  """The pipelined tree from every stage's own tree: stacked leaves are joined without a
  copy; the embedding, final norm and head are copied from their owning stage to all."""
  stages = len(stage_trees)
  out = {}
  for key, spec in specs.items():
    if key == STAGES:
      def join(spec, *parts):
        whole = (stages, *parts[0].shape[1:])
        shards = [s.data for part in parts for s in part.addressable_shards]
        return jax.make_array_from_single_device_arrays(whole, NamedSharding(mesh, spec), shards)
      out[key] = jax.tree.map(join, spec, *[t[key] for t in stage_trees],
                              is_leaf=lambda x: isinstance(x, P))
    else:
      owner = 0 if key in _FIRST_KEYS else stages - 1
      out[key] = jax.tree.map(lambda s, a: jax.device_put(a, NamedSharding(mesh, s)), spec,
                              stage_trees[owner][key], is_leaf=lambda x: isinstance(x, P))
  return out


def _layer(stacked: jax.Array, j: int) -> jax.Array:
  """Layer j of a stage's stacked (1, n, ...) leaf, by static slices (no index array:
  the leaf may live in host memory, which an index on the device could not address)."""
  one = jax.lax.index_in_dim(stacked, 0, 0, keepdims=False)
  return jax.lax.index_in_dim(one, j, 0, keepdims=False)


def stage_to_canonical(stage_trees: list[Any], shape: Shape) -> Any:
  """Canonical params (each leaf where its stage keeps it) from every stage's tree."""
  names = _block_names(shape)
  n = shape.layers_per_stage
  blocks = {}
  for s, tree in enumerate(stage_trees):
    for j in range(n):
      blocks[names[s * n + j]] = jax.tree.map(lambda a, j=j: _layer(a, j), tree[STAGES])
  out = {'blocks': blocks}
  for key in _FIRST_KEYS:
    out[key] = stage_trees[0][key]
  for key in _LAST_KEYS:
    out[key] = stage_trees[-1][key]
  return out


def make_from_pipelined(shape: Shape, mesh: Mesh, specs: Any) -> Callable[[Any], Any]:
  """A jitted map from the pipelined tree to canonical params on the whole mesh (each
  block's leaves then on every stage: the form checkpoints save and an unpipelined run
  has)."""
  names = _block_names(shape)
  n = shape.layers_per_stage
  is_spec = lambda x: isinstance(x, P)

  def unstack(tree):
    out = {k: v for k, v in tree.items() if k != STAGES}
    out['blocks'] = {names[i]: jax.tree.map(lambda a, i=i: a[i // n, i % n], tree[STAGES])
                     for i in range(shape.n_layers)}
    return out

  out_specs = {k: v for k, v in specs.items() if k != STAGES}
  out_specs['blocks'] = {name: jax.tree.map(lambda s: P(*s[2:]), specs[STAGES], is_leaf=is_spec)
                         for name in names}
  out_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=is_spec)
  return jax.jit(unstack, out_shardings=out_shardings)


def canonical_to_stages(canonical: Any, shape: Shape) -> list[Any]:
  """Every stage's own tree (host numpy arrays) from canonical params."""
  piped = to_pipelined(canonical, shape)
  trees = []
  for s in range(shape.stages):
    tree = {k: piped[k] for k in owned_keys(s, shape.stages) if k != STAGES}
    tree[STAGES] = jax.tree.map(lambda a, s=s: a[s:s + 1], piped[STAGES])
    trees.append(tree)
  return trees
