"""The step lines of `dos-jax plan`: a plan's step as the program runs it
(`timeline`, with early host calls) and the step across nodes (`internode`)."""

from __future__ import annotations

from dos_jax import pinned_pool
from dos_jax.planner import costmodel
from dos_jax.planner import timeline
from dos_jax.planner.plan_args import gib as _gib
from dos_jax.planner.plan_args import ms as _ms


def across_nodes(profile, shape, nodes: int, devices: int, param_bytes: int, iteration,
                 host_state: float, pool: float) -> list[str]:
  """The step across `nodes` nodes (`costmodel.internode`), and host memory per node."""
  n = shape.num_params()
  link = costmodel.internode(profile, nodes, grad_bytes=n * param_bytes,
                             param_bytes=n * param_bytes)
  out = [f'\nacross {nodes} nodes ({nodes * devices} devices; inter-node link'
         f' {profile.internode_gbps:g} GB/s per node each way, ring collectives over the'
         ' nodes):',
         f'  gradient reduce-scatter {_ms(link.reduce_scatter_seconds)} + new params'
         f' all-gather {_ms(link.all_gather_seconds)} ({_gib(link.link_bytes)} through each'
         ' node\'s link per step: an all-reduce\'s traffic)']
  if iteration is not None:
    step = iteration.iteration_seconds + link.seconds
    out.append(f'  step (Auto\'s plan): iteration {_ms(iteration.iteration_seconds)} +'
               f' collectives {_ms(link.seconds)} = {_ms(step)}, counted exposed (no'
               f' overlap with the backward pass: an upper bound)')
  out.append(f'  host memory per node: optimizer state {_gib(host_state)}, pinned pool'
             f' {_gib(pool)} ({pinned_pool.ENV_VAR}={pinned_pool.required_gib(pool)} with'
             f' one process per node)')
  return out


def chunk_line(profile, spec, name, plan, fwd, bwd, clip_rate: float) -> str:
  """A plan's step as the program runs it (`timeline`): its host update in one host call,
  and in the early host calls `choose_early_calls` picks at `clip_rate`."""
  times = dict(forward_seconds=fwd, backward_seconds=bwd)
  one = timeline.timeline(profile, spec, plan, **times).seconds
  early, mean = timeline.choose_early_calls(profile, spec, plan, clip_rate=clip_rate, **times)
  line = (f'{name} as the step runs it (dos_jax.planner.timeline): one host call after the'
          f' backward pass {_ms(one)}')
  if not early:
    return line + f'; early host calls do not help at a clip rate of {clip_rate:g}'
  calm, fired = (timeline.early_timeline(profile, spec, plan, early=early, rollback=r,
                                         **times).seconds for r in (False, True))
  calls = f'{len(early)} early host call' + ('s' if len(early) > 1 else '')
  undo = sum(early) * spec.subgroup_size * spec.state_bytes_per_element
  return (line + f'; {calls} of {early[0]} subgroup{"s" if early[0] > 1 else ""}'
          f' during the backward pass (Partition.early: ({early[0]},) x {len(early)}),'
          f' speculating on the clip factor: {_ms(calm)}, {_ms(fired)} on a step that rolls'
          f' back, mean {_ms(mean)} at a clip rate of {clip_rate:g} ({one / mean:.2f}x);'
          f' their undo copy takes {_gib(undo)} of host memory')
