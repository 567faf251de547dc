"""Sizes of a pipelined run, stage by stage, and the GPipe bubble.

A pipelined model is split into S stages of n_layers / S consecutive blocks; the first
stage also holds the input embedding, the last the final norm and the output head (as
`dos_jax.train.pipeline` places them). Each stage's params, gradients and optimizer state
are sharded over that stage's own devices only, and under GPipe each stage keeps the
activations of all M microbatches of a step until its backward pass.
"""

from __future__ import annotations

import dataclasses
import math


def bubble_fraction(stages: int, microbatches: int) -> float:
  """Idle share of a GPipe step: (S-1)/(M+S-1); 0 for one stage."""
  return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class StageSize:
  """What one device of one stage holds, in bytes, and the stage's host state."""

  stage: int
  first_layer: int
  last_layer: int
  num_params: int  # The whole stage's parameters.
  params: float  # Per device.
  grads: float  # Per device.
  activations: float  # Per device, all microbatches of a step.
  host_state: float  # The whole stage (on its node's pinned host memory).


def stage_sizes(shape, *, stages: int, microbatches: int, devices: int, param_bytes: int,
                state_bytes: int, layer_activation_bytes: float) -> list[StageSize]:
  """Per-stage sizes of `shape` (a `ModelShape`) on `devices` devices in all.

  Args:
    stages: S; must divide `shape.n_layers` and `devices`.
    microbatches: M, microbatches per step.
    devices: devices in all; each stage gets devices / S of them, sharing its state.
    layer_activation_bytes: bytes one layer keeps for its backward pass, for one
      microbatch on one device (`memory.layer_activation_bytes`).

  Raises:
    ValueError: the stages do not divide the layers or the devices.
  """
  if shape.n_layers % stages:
    raise ValueError(f'{stages} stages do not split {shape.n_layers} layers evenly')
  if devices % stages:
    raise ValueError(f'{stages} stages do not split {devices} devices evenly')
  per_stage_devices = devices // stages
  layers = shape.n_layers // stages
  embed = shape.vocab_size * shape.dim
  head = 0 if shape.tie_embeddings else embed
  per_block = (shape.num_params() - shape.dim - embed - head) // shape.n_layers
  out = []
  for s in range(stages):
    n = layers * per_block + (embed if s == 0 else 0)
    n += (head + shape.dim) if s == stages - 1 else 0
    local = math.ceil(n / per_stage_devices)
    acts = layers * microbatches * layer_activation_bytes
    out.append(StageSize(
        stage=s, first_layer=s * layers, last_layer=(s + 1) * layers - 1, num_params=n,
        params=local * param_bytes, grads=local * param_bytes, activations=acts,
        host_state=n * state_bytes,
    ))
  return out


def report(sizes: list[StageSize], *, microbatches: int, gib) -> list[str]:
  """Lines for `dos-jax plan`: the bubble, then one row per stage."""
  stages = len(sizes)
  lines = [
      f'pipeline: {stages} stages x {microbatches} microbatches (GPipe): bubble'
      f' {bubble_fraction(stages, microbatches):.1%} of each step ((S-1)/(M+S-1))',
      f'  {"stage":>5} {"layers":>9} {"params":>10} {"params/dev":>12} {"grads/dev":>12}'
      f' {"activations/dev":>16} {"host state":>12}',
  ]
  for z in sizes:
    lines.append(
        f'  {z.stage:>5} {f"{z.first_layer}-{z.last_layer}":>9} {z.num_params / 1e6:>9.1f}M'
        f' {gib(z.params):>12} {gib(z.grads):>12} {gib(z.activations):>16}'
        f' {gib(z.host_state):>12}')
  return lines
