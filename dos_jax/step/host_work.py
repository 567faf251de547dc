"""`HostWork`: the host tier's calls that run beside the device tiers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

from dos_jax.geometry.partition import Tier
from dos_jax.step import device_stream


def _no_inputs() -> dict:
  return {}


def _no_token(result) -> None:
  del result


@dataclasses.dataclass(frozen=True)
class HostItem:
  """One host region of the step, traced by whoever runs it in three calls, so that the
  kernel call sits right below the construction:

      item.record(item.region(link=link, **item.inputs()))

  Attributes:
    region: the region (a kernel call site); `link` is a `(1,)` zero in host memory made
      on the device from the tokens of the call before (None: no call before).
    inputs: `() -> keyword arguments of region`: what it reads, sent to host memory at
      the point the region is traced (inside its call's context).
    record: `(region's result) -> token`: keeps the new arrays and out rows; the token
      (a device array computed from the region's results, or None) is what the next
      call's link is made from.
  """

  region: Callable[..., Any]
  inputs: Callable[[], dict] = _no_inputs
  record: Callable[[Any], Any] = _no_token


def run(item: HostItem, link) -> Any:
  """Traces `item` with `link`; returns its token."""
  return item.record(item.region(link=link, **item.inputs()))


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
      run(item, self.link)
    with device_stream.in_group(group) if group is not None else contextlib.nullcontext():
      for item in self.items:
        run(item, self.link)
    return self.finish()

  def every_item(self) -> list[HostItem]:
    """`ungrouped` then `items`: what the staged lowering spreads over its stages."""
    return list(self.ungrouped) + list(self.items)

  def then(self, *items: HostItem) -> 'HostWork':
    """This work with `items` run after it, in the group; the rest ungrouped (the disk
    calls: the longest host work, what the device tiers run beside)."""
    return dataclasses.replace(self, items=list(items), ungrouped=self.every_item())


def _tier_region(context, base_step, host_tier: tuple, native: bool, link):
  del link  # the tier's one host call has no call before it to wait for
  return context.update_tier(Tier.HOST, base_step, host_tier, native=native)


def of_tier(context, base_step, host_tier: tuple, native: bool) -> HostWork:
  """The host tier in one item (`StepContext.update_tier`); no item where it is empty."""
  done = {}
  item = HostItem(region=functools.partial(_tier_region, context, base_step, host_tier, native),
                  record=functools.partial(done.__setitem__, 'result'))
  return HostWork(items=[item] if context.part.ids(Tier.HOST) else [],
                  finish=lambda: done.get('result', (host_tier, [])))
