"""The data-parallel collectives of a multi-node run over the inter-node link
(`dos-jax plan --nodes`), re-exported by `costmodel`."""

from __future__ import annotations

import dataclasses

from dos_jax.planner.hardware import HardwareProfile

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Internode:
  """The data-parallel collectives of one step across nodes, over the inter-node link.

  Attributes:
    nodes: nodes taking part.
    link_bytes: bytes each node sends (and receives) over its inter-node link.
    reduce_scatter_seconds: the gradients' reduce-scatter (the state, and so the update
      of each slice, is sharded over every device of every node).
    all_gather_seconds: the new parameters' all-gather after the update (together with
      the reduce-scatter: the traffic of an all-reduce).
  """

  nodes: int
  link_bytes: float
  reduce_scatter_seconds: float
  all_gather_seconds: float

  @property
  def seconds(self) -> float:
    return self.reduce_scatter_seconds + self.all_gather_seconds


def internode(profile: HardwareProfile, nodes: int, *, grad_bytes: float,
              param_bytes: float) -> Internode:
  """The inter-node part of a step's data-parallel collectives on `nodes` nodes.

  `grad_bytes`, `param_bytes`: the whole model's gradients and params (every replica
  holds them whole or in slices). A ring over the nodes moves (N-1)/N of each tensor
  through every node's link each way, at `profile.internode_gbps`; the exchange among
  the devices of a node (NVLink or PCIe) is not counted, nor any overlap with the
  backward pass (XLA may start the reduce-scatter of early gradients while it runs):
  an upper bound on what the link adds to a step. One node: nothing."""
  if nodes < 1:
    raise ValueError(f'nodes must be >= 1, got {nodes}')
  share = (nodes - 1) / nodes
  rate = profile.internode_gbps * _GB
  return Internode(nodes=nodes, link_bytes=share * (grad_bytes + param_bytes),
                   reduce_scatter_seconds=share * grad_bytes / rate,
                   all_gather_seconds=share * param_bytes / rate)

