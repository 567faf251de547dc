"""The sharding table: which mesh axis splits which dimension of every model tensor.

Megatron-style tensor parallelism over the `tensor` axis: attention q/k/v are split by
head (column-parallel) and the output projection by head on its input side (row-parallel),
so each device computes whole heads and one all-reduce closes the attention block; the
SwiGLU gate/up kernels are column-split and down row-split, likewise. Embedding and output
head are split over the vocabulary. Norm scales are replicated. The batch is split over
`data`; `pipeline` splits the layers into stages (dos_jax/train/pipeline.py).

ZeRO-3 (`megatron_fsdp`, MaxText's `fsdp` axis): every matrix is also split over `fsdp`,
on the dimension the `tensor` split leaves whole (the model width D), and the batch over
`data` x `fsdp`. jit and the shardings make XLA gather each matrix before it is used and
reduce-scatter its gradient; no collective is written by hand. The model pins its
activations batch-split (`model.py`): without that, XLA's partitioner moved the whole
batch's activations instead for some layers (experiments/RESULTS.md,
`memory-zero3-activations`).

The table is matched against the leaf names `model.py` gives its parameters; a parameter
the table does not know is an error, never silently replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, TENSOR, PIPELINE = 'data', 'tensor', 'pipeline'
MESH_AXES = (DATA, TENSOR, PIPELINE)
FSDP = 'fsdp'
# The runner's mesh when `mesh.fsdp` > 1.
FSDP_MESH_AXES = (DATA, FSDP, TENSOR, PIPELINE)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """The PartitionSpec of each kind of parameter (shapes as in `model.py`)."""

  # Input embedding, (V, D).
  embedding: P = P(TENSOR, None)
  # Attention q, k and v kernels, (D, H, K) and (D, G, K): column-parallel, whole heads
  # per device; with G < H key/value heads, whole groups (a device's query heads read only
  # its own key/value heads, so G must divide by `tensor`).
  attn_qkv: P = P(None, TENSOR, None)
  # Attention output kernel, (H, K, D): row-parallel over the same heads.
  attn_out: P = P(TENSOR, None, None)
  # SwiGLU gate and up kernels, (D, F): column-parallel.
  mlp_in: P = P(None, TENSOR)
  # SwiGLU down kernel, (F, D): row-parallel.
  mlp_out: P = P(TENSOR, None)
  # RMSNorm scales, (D,): small, replicated.
  norm: P = P(None)
  # Output head, (D, V): split over the vocabulary (absent with tied embeddings: the
  # embedding's vocabulary split then splits the logits alike).
  head: P = P(None, TENSOR)

  @classmethod
  def megatron(cls) -> ShardingRules:
    """Tensor-parallel layout described in the module docstring (the default)."""
    return cls()

  @classmethod
  def megatron_fsdp(cls) -> ShardingRules:
    """As `megatron`, and every matrix split over `fsdp` on its model-width (D)
    dimension: ZeRO-3 beside the tensor split. Norm scales stay replicated (D floats)."""
    return cls(
        embedding=P(TENSOR, FSDP),
        attn_qkv=P(FSDP, TENSOR, None),
        attn_out=P(TENSOR, None, FSDP),
        mlp_in=P(FSDP, TENSOR),
        mlp_out=P(TENSOR, FSDP),
        head=P(FSDP, TENSOR),
    )

  @classmethod
  def megatron_embed_over_dim(cls) -> ShardingRules:
    """As `megatron`, but the input embedding is split over D: each device gathers its
    own slice of every looked-up row instead of a vocabulary range."""
    return cls(embedding=P(None, TENSOR))

  @classmethod
  def replicated(cls) -> ShardingRules:
    """Every parameter whole on every device (pure data parallelism)."""
    return cls(**{f.name: P(*(None,) * len(f.default)) for f in dataclasses.fields(cls)})


# Leaf name in the params dict -> field of ShardingRules.
_RULE_OF_LEAF = {
    'embedding': 'embedding',
    'wq': 'attn_qkv',
    'wk': 'attn_qkv',
    'wv': 'attn_qkv',
    'wo': 'attn_out',
    'w_gate': 'mlp_in',
    'w_up': 'mlp_in',
    'w_down': 'mlp_out',
    'scale': 'norm',
    'head': 'head',
}


def path_str(path) -> str:
  """'blocks/0/attn/wq' for a jax key path."""
  parts = []
  for key in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


def param_specs(params: Any, rules: ShardingRules = ShardingRules()) -> Any:
  """The PartitionSpec of every parameter, in a tree shaped like `params`.

  Args:
    params: the model's parameter dict (arrays or jax.ShapeDtypeStruct leaves).
    rules: the table to apply.

  Raises:
    ValueError: naming the parameter path, if no rule matches a leaf or a rule's rank
      differs from the parameter's.
  """

  def spec(path, leaf):
    name = path_str(path)
    last = name.rsplit('/', 1)[-1]
    if last not in _RULE_OF_LEAF:
      raise ValueError(f'no sharding rule for parameter {name!r} (leaf name {last!r})')
    rule = getattr(rules, _RULE_OF_LEAF[last])
    if len(rule) != len(leaf.shape):
      raise ValueError(
          f'sharding rule {_RULE_OF_LEAF[last]}={rule} has {len(rule)} dims but parameter '
          f'{name!r} has shape {tuple(leaf.shape)}'
      )
    return rule

  return jax.tree_util.tree_map_with_path(spec, params)


def fsdp_dims(params: Any, rules: ShardingRules | None = None) -> Any:
  """Per parameter, the dimension `rules` (default `megatron_fsdp`) split first over
  `fsdp`, or None: the ZeRO-3 shards the optimizer packs its state by, so that each
  device packs and unpacks only its own (`dos_jax.adamw(shard_dims=...)`)."""
  rules = ShardingRules.megatron_fsdp() if rules is None else rules

  def dim(spec):
    for d, axes in enumerate(spec):
      if (axes[0] if isinstance(axes, tuple) and axes else axes) == FSDP:
        return d
    return None

  return jax.tree.map(dim, param_specs(params, rules), is_leaf=lambda x: isinstance(x, P))


def batch_spec(fsdp: bool = False) -> P:
  """Token batches (B, L + 1): rows split over `data` (and `fsdp`, with ZeRO-3)."""
  return P((DATA, FSDP), None) if fsdp else P(DATA, None)


def check_divisible(params: Any, specs: Any, axis_sizes: Mapping[str, int]) -> None:
  """Raises a ValueError naming the parameter, dimension and axis whose size does not
  divide evenly (e.g. 6 heads over tensor=4), instead of a placement error from XLA."""

  def check(path, leaf, spec):
    for dim, (size, axes) in enumerate(zip(leaf.shape, spec)):
      if axes is None:
        continue
      names = axes if isinstance(axes, tuple) else (axes,)
      parts = 1
      for axis in names:
        parts *= axis_sizes.get(axis, 1)
      if size % parts:
        raise ValueError(
            f'parameter {path_str(path)!r} dimension {dim} of size {size} does not split '
            f'evenly over mesh axes {"x".join(names)} = {parts}'
        )

  jax.tree_util.tree_map_with_path(
      check, params, specs, is_leaf=lambda x: isinstance(x, P)
  )


def param_shardings(
    params: Any,
    mesh: Mesh,
    rules: ShardingRules = ShardingRules(),
    memory_kind: str | None = None,
) -> Any:
  """NamedShardings for `params` on `mesh`, after checking that every split is even."""
  specs = param_specs(params, rules)
  check_divisible(params, specs, dict(mesh.shape))
  return jax.tree.map(
      lambda spec: NamedSharding(mesh, spec, memory_kind=memory_kind),
      specs,
      is_leaf=lambda x: isinstance(x, P),
  )
