"""`HostWork`: the host tier's calls that run beside the device tiers."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from dos_jax import lowering as lowering_lib
from dos_jax.geometry.partition import Tier
from dos_jax.step import device_stream

# item(link) -> token: one host region, traced when called. `link` is a (1,) zero in host
# memory made on the device from the tokens of the call before (None: no call before);
# the token is a device array computed from the region's results (None: none), from
# which the next call's link is made.
HostItem = Callable[[Any], Any]


@dataclasses.dataclass
class HostWork:
  """The host regions of one step still to trace once the early host calls are built.

  Attributes:
    items: the regions that run beside the device tiers, in order.
    finish: `() -> (new host tier arrays, [(out rows, pieces)])`, once every item ran.
    link: the link the first items take (the last early call's), or None.
    ungrouped: regions traced before `items`, outside the device tiers' group, in the
      lowering that groups one host call (`dos_jax.lowering.Lowering.IN_REGION`).
  """

  items: list[HostItem]
  finish: Callable[[], tuple[tuple, list]]
  link: Any = None
  ungrouped: list[HostItem] = dataclasses.field(default_factory=list)

  def run_grouped(self, group: int | None) -> tuple[tuple, list]:
    """Traces every region, `items` in scheduling group `group` (one host call), and
    returns `finish()`."""
    for item in self.ungrouped:
      item(self.link)
    with device_stream.in_group(group) if group is not None else contextlib.nullcontext():
      for item in self.items:
        item(self.link)
    return self.finish()

  def every_item(self) -> list[HostItem]:
    """`ungrouped` then `items`: what the staged lowering spreads over its stages."""
    return list(self.ungrouped) + list(self.items)

  def then(self, *items: HostItem) -> 'HostWork':
    """This work with `items` run after it, in the group; the rest ungrouped (the disk
    calls: the longest host work, what the device tiers run beside)."""
    return dataclasses.replace(self, items=list(items), ungrouped=self.every_item())


def of_tier(context, base_step, host_tier: tuple, native: bool) -> HostWork:
  """The host tier in one item (`StepContext.update_tier`); no item where it is empty."""
  done = {}

  def item(link):
    del link  # the tier's one host call has no call before it to wait for
    done['result'] = context.update_tier(Tier.HOST, base_step, host_tier, native=native)

  return HostWork(items=[item] if context.part.ids(Tier.HOST) else [],
                  finish=lambda: done.get('result', (host_tier, [])))
