"""One training step as the compiled program runs it: when the device, the two link
directions and the host are busy, for a plan whose host tier runs in early host calls
and a last one (`dos_jax.step.early_calls`).

`predict` gives the update phase as a roofline; this follows the order the step's
construction forces (`dos_jax.step.early_calls`, `lanes`, `tier_updates`), so that it can
be put beside a compiled schedule's order of starts and dones (`early_timeline`):

* the device runs the forward and backward passes. Host-bound gradients leave as the
  backward pass makes them, the last subgroups first (those without weight decay, the
  norm scales, once it is over: `host_order`), one after another on the D2H link;
* early call k starts once its gradients are in host memory and call k-1 is done,
  during the backward pass; a done blocks the thread that launches GPU work;
* the last host call starts after the backward pass, in one group with the device
  tiers' stream lanes;
* the host blocks' new params go back over H2D after the last call; the step ends when
  the device and the last params are done, plus the layout's packing and unpacking.

With no early call (`timeline`) this is the step `predict` describes: one host call
that starts after every host-bound gradient is in host memory, the stream inside its
window.
"""

from __future__ import annotations

import dataclasses

from dos_jax.geometry import partition as partition_lib
from dos_jax.planner import costmodel
from dos_jax.planner.hardware import HardwareProfile
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Span:
  """One piece of work on one lane: 'device', 'h2d', 'd2h' or 'host'."""

  lane: str
  name: str
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The spans of one step, in start order."""

  spans: tuple[Span, ...]

  @property
  def seconds(self) -> float:
    """The step: from the forward pass to the last span's end."""
    return max(s.end for s in self.spans)

  def span(self, name: str) -> Span:
    return next(s for s in self.spans if s.name == name)

  def events(self) -> list[tuple[float, str]]:
    """Every span's start and end as `(seconds, 'name start' | 'name end')`, in time
    order: the order to put beside a schedule's starts and dones."""
    out = [(s.start, f'{s.name} start') for s in self.spans]
    out += [(s.end, f'{s.name} end') for s in self.spans]
    return sorted(out, key=lambda e: e[0])

  def table(self) -> str:
    """One line per span: start and end in ms, lane, name."""
    return '\n'.join(f'{1e3 * s.start:9.2f} {1e3 * s.end:9.2f} ms  {s.lane:6} {s.name}'
                     for s in self.spans)


def host_order(spec: SubgroupSpec, plan: Plan) -> list[int]:
  """The host subgroups in the order the step's host calls take them
  (`dos_jax.step.early_calls.host_blocks`): the last first, those past `spec.decayed_rows`
  (the norm scales, complete at the end of the backward pass) last."""
  order = sorted(plan.host, reverse=True)
  if spec.decayed_rows is None:
    return order
  return ([g for g in order if g < spec.decayed_rows]
          + [g for g in order if g >= spec.decayed_rows])


def gradient_arrivals(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan,
                      forward_seconds: float, backward_seconds: float) -> tuple[dict, float]:
  """`(when each host subgroup's gradients are in host memory, when the D2H link is
  free)`: they leave as the backward pass makes them, in `host_order`, one after
  another on the link; the rows past `spec.decayed_rows` once it is over."""
  sizes, n = costmodel.subgroup_sizes(spec), spec.num_subgroups
  gb = costmodel.host_pull_bytes(spec)
  late = n if spec.decayed_rows is None else spec.decayed_rows
  arrived, link_free = {}, 0.0
  for g in host_order(spec, plan):
    made = forward_seconds + backward_seconds * ((n - g) / n if g < late else 1.0)
    link_free = max(made, link_free) + gb * sizes[g] / (profile.d2h_gbps * _GB)
    arrived[g] = link_free
  return arrived, link_free


def timeline(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, *,
             forward_seconds: float, backward_seconds: float) -> Timeline:
  """The step of `plan` with its host tier in one host call: `early_timeline` with no
  early call (the step `predict` describes).

  Example:
    >>> from dos_jax.planner import costmodel, timeline
    >>> from dos_jax.policies import Stride, SubgroupSpec
    >>> spec = SubgroupSpec(num_subgroups=8, subgroup_size=10**7, num_elements=8 * 10**7)
    >>> profile = costmodel.PROFILE_PRESETS['h100-pcie5']
    >>> t = timeline.timeline(profile, spec, Stride(2).plan(spec), forward_seconds=0.1,
    ...                       backward_seconds=0.2)
    >>> t.span('last call').start >= 0.3  # after the backward pass
    True
  """
  return early_timeline(profile, spec, plan, forward_seconds=forward_seconds,
                        backward_seconds=backward_seconds, early=1)


def early_timeline(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, *,
                   forward_seconds: float, backward_seconds: float, early,
                   rollback: bool = False) -> Timeline:
  """The step of `plan` with its host tier in the host calls of
  `early` (an int K or a tuple of early call sizes, `Partition.early`; see
  `dos_jax.step.early_calls`):

  * early call k (all but the last) starts once its gradients are in host memory and
    call k-1 is done, during the backward pass; its done comes before the next call's
    start, so a call longer than the backward compute it overlaps stalls the device
    (the done blocks the thread that launches GPU work) and delays what follows;
  * the last call (the last call, plus, on a `rollback` step, the early calls again)
    starts after the backward pass, in one group with the device tiers' stream;
  * every host block's params go back over H2D after the last call.

  `rollback`: this step's clip factor is not 1, so the early calls are redone (the
  early calls never wait for the clip factor).

  Example:
    >>> from dos_jax.planner import costmodel, timeline
    >>> from dos_jax.policies import Stride, SubgroupSpec
    >>> spec = SubgroupSpec(num_subgroups=8, subgroup_size=10**7, num_elements=8 * 10**7)
    >>> profile = costmodel.PROFILE_PRESETS['h100-pcie5']
    >>> t = timeline.early_timeline(profile, spec, Stride(2).plan(spec), forward_seconds=0.1,
    ...                             backward_seconds=0.2, early=4)
    >>> t.span('early call 1').start < 0.3  # during the backward pass
    True
  """
  sizes = costmodel.subgroup_sizes(spec)
  pred = costmodel.predict(profile, spec, plan, backward_seconds=backward_seconds)
  arrived, link_free = gradient_arrivals(profile, spec, plan, forward_seconds, backward_seconds)
  parts = partition_lib.host_calls(host_order(spec, plan), early)
  count = len(parts)
  u_host = profile.host_adamw_gparams() * _GB
  slowdown = profile.host_copy_slowdown
  spans, delay, host_done = [], 0.0, 0.0
  early_work = 0.0
  for k, hosts in enumerate(parts[:-1], 1):
    ready = max(arrived[g] for g in hosts) + delay
    start = max(ready, host_done)
    work = sum(sizes[g] for g in hosts) / u_host
    early_work += work
    host_done = start + costmodel._slowed(work, max(0.0, link_free + delay - start), slowdown)  # pylint: disable=protected-access
    spans.append(Span('host', f'early call {k}', start, host_done))
    following = parts[k] if k < len(parts) - 1 else None
    next_ready = (max(arrived[g] for g in following) if following is not None
                  else forward_seconds + backward_seconds) + delay
    delay += max(0.0, host_done - next_ready)  # the done holds the launch thread
  backward_end = forward_seconds + backward_seconds + delay
  spans += [Span('device', 'forward', 0.0, forward_seconds),
            Span('device', 'backward', forward_seconds, backward_end)]
  if plan.host:
    spans.append(Span('d2h', 'host-bound gradients', forward_seconds, link_free + delay))
  both = bool(plan.streamed) and (plan.buffers >= 2 or bool(plan.host))
  stream = costmodel.stream_seconds(profile, spec, plan, [sizes[g] for g in plan.streamed],
                                    both=both)
  last = parts[-1]
  ready = max([arrived[g] + delay for g in last] + [backward_end])
  start = max(ready, host_done)
  device = backward_end
  if len(last) or rollback:
    work = sum(sizes[g] for g in last) / u_host + (early_work if rollback else 0.0)
    host_done = start + costmodel._slowed(work, stream, slowdown)  # pylint: disable=protected-access
    name = 'last call' + (' and redo' if rollback and count > 1 else '')
    spans.append(Span('host', name, start, host_done))
  if plan.streamed or plan.resident:
    spans.append(Span('device', 'device tiers', start, start + stream))
    device = start + stream
  device = max(device, host_done)
  params_free = host_done
  if plan.host:
    params_free = host_done + spec.param_bytes_per_element * sum(
        sizes[g] for g in plan.host) / (profile.h2d_gbps * _GB)
    spans.append(Span('h2d', 'params', host_done, params_free))
  end = max(device, params_free)
  spans.append(Span('device', 'layout and apply', end, end + pred.layout_seconds))
  return Timeline(tuple(sorted(spans, key=lambda s: (s.start, s.end))))


def expected_early_seconds(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, *,
                           forward_seconds: float, backward_seconds: float, early,
                           clip_rate: float) -> float:
  """The mean step with the early host calls `early` when a fraction `clip_rate` of steps
  roll back (their clip factor is not 1)."""
  if not 0.0 <= clip_rate <= 1.0:
    raise ValueError(f'clip_rate must be in [0, 1], got {clip_rate}')
  kwargs = dict(forward_seconds=forward_seconds, backward_seconds=backward_seconds,
                early=early)
  calm = early_timeline(profile, spec, plan, rollback=False, **kwargs).seconds
  if len(partition_lib.host_calls(plan.host, early)) <= 1 or clip_rate == 0.0:
    return calm
  fired = early_timeline(profile, spec, plan, rollback=True, **kwargs).seconds
  return (1.0 - clip_rate) * calm + clip_rate * fired


def choose_early_calls(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, *,
                        forward_seconds: float, backward_seconds: float, clip_rate: float,
                        sizes: tuple[int, ...] = (1, 2, 4, 8)
                        ) -> tuple[tuple[int, ...], float]:
  """`(early_calls, mean step seconds)`: early calls of one size from `sizes`, as many
  as make the mean step (at this clip rate) shortest, the rest in the last call. `()`
  when no early call helps (one host call after the backward pass). Ties go to fewer
  early subgroups.

  A call fits when it ends before the backward compute its window overlaps; one that
  does not holds the launch thread (`early_timeline`), so the best plan speculates only
  on what the backward pass can hide.
  """
  kwargs = dict(forward_seconds=forward_seconds, backward_seconds=backward_seconds,
                clip_rate=clip_rate)
  best = ((), expected_early_seconds(profile, spec, plan, early=1, **kwargs))
  hosts = len(plan.host)
  for size in sizes:
    for calls in range(1, (hosts - 1) // size + 1):
      early = (size,) * calls
      seconds = expected_early_seconds(profile, spec, plan, early=early, **kwargs)
      if seconds < best[1] * (1 - 1e-9):
        best = (early, seconds)
  return best


class EarlyChooser:
  """The early host calls of any policy's plan, chosen by `choose_early_calls`, as
  `dos_jax.Auto.early_calls` does for its own (the runner's, on a GPU:
  `train/optimizer.choose_early_calls`).

  Example:
    >>> from dos_jax.planner import costmodel, timeline
    >>> from dos_jax.policies import AllHost, SubgroupSpec
    >>> spec = SubgroupSpec(num_subgroups=70, subgroup_size=10**8, num_elements=7 * 10**9)
    >>> chooser = timeline.EarlyChooser(costmodel.PROFILE_PRESETS['h100-pcie5'],
    ...                                 backward_seconds=2.0)
    >>> len(chooser.early_calls(spec, AllHost().plan(spec))) > 0
    True
  """

  def __init__(self, profile: HardwareProfile | None = None, *, backward_seconds: float,
               clip_rate: float = 0.1):
    """Args:
      profile: the machine; None calibrates this one on first use (cached, as `Auto`).
      backward_seconds: the backward pass the early calls run beside.
      clip_rate: the fraction of steps that roll back; `observe_rollbacks` measures it.
    """
    if not 0.0 <= clip_rate <= 1.0:
      raise ValueError(f'EarlyChooser.clip_rate must be in [0, 1], got {clip_rate!r}')
    self._profile = profile
    self.backward_seconds = backward_seconds
    self.clip_rate = clip_rate

  def __repr__(self):
    return (f'EarlyChooser(backward_seconds={self.backward_seconds:g},'
            f' clip_rate={self.clip_rate:g})')

  @property
  def profile(self) -> HardwareProfile:
    if self._profile is None:
      from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
      self._profile = calibrate.cached_profile()
    return self._profile

  def early_calls(self, spec: SubgroupSpec, plan: Plan) -> tuple[int, ...]:
    """The early calls of `plan`: `choose_early_calls` with the forward pass taken as
    half the backward; `()` when none helps or the backward pass is not known."""
    if self.backward_seconds <= 0 or len(plan.host) < 2:
      return ()
    early, _ = choose_early_calls(
        self.profile, spec, plan, forward_seconds=self.backward_seconds / 2,
        backward_seconds=self.backward_seconds, clip_rate=self.clip_rate)
    return early

  def observe_rollbacks(self, rollbacks: int, steps: int) -> None:
    """Takes the clip rate measured over `steps` steps for the next choice."""
    if steps > 0 and 0 <= rollbacks <= steps:
      self.clip_rate = rollbacks / steps
