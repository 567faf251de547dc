"""`dos-jax plan`: memory per tier, the chosen placement and predicted times, before a run.

Takes a model (a size preset or a run config) and a hardware profile (a preset node,
this machine by calibration, or a JSON file), and prints the device and pinned-host
memory the run needs, the plan `Auto` would choose and its predicted update and
iteration times next to the fixed baselines. Exit status: 0 when the model fits,
1 when it does not (with the missing amount), 2 for bad arguments.

With a preset and no other flags it assumes the paper's runs: bf16, 2048-token
sequences, micro-batch 1, cuDNN's flash attention on GPU profiles, no activation
checkpointing, params, grads and state sharded over the node's devices (ZeRO-3). With
`--config` those come from the run config; a flag given overrides either.

`--nodes N`: the run spans N such nodes, the state sharded over every device of all of
them; the step then counts the data-parallel collectives over the inter-node link
(`costmodel.internode`), and host memory is given per node.

`--disk DIR` or `--disk-gbps READ,WRITE` adds the disk tier: the host subgroups' state
beyond the node's host memory (`--host-memory-gib`) goes to disk (`plan_disk`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable

from dos_jax.planner import auto
from dos_jax.planner import costmodel
from dos_jax.planner import memory
from dos_jax.planner import plan_disk
from dos_jax.planner import plan_table
from dos_jax import model_shapes
from dos_jax import pinned_pool
from dos_jax.planner.plan_args import fraction as _fraction
from dos_jax.planner.plan_args import gib as _gib
from dos_jax.planner.plan_args import parse_bytes as parse_bytes
from dos_jax.planner.plan_args import positive_float as _positive_float
from dos_jax.planner.plan_args import positive_int as _positive_int
from dos_jax.planner.costmodel import HardwareProfile
from dos_jax.policies import SubgroupSpec

_PROG = 'dos-jax plan'
_THIS = 'this'
# Achieved training TFLOP/s per GPU, used to estimate forward/backward time. H100: what
# the paper's 20B run achieved (2NT FLOPs forward in 288 ms and 4NT backward in 852 ms
# per GPU, ~190-280 TFLOP/s); A100: assumed, ~1/3 of its 312 TFLOP/s bf16 peak.
_DEFAULT_TFLOPS = {'h100-pcie5': 200.0, 'a100-pcie4': 100.0}

@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What `--config` takes from a run config (read by the runner's loader, handed down
  by `dos_jax.cli` so that the planner never imports the runner).

  Attributes:
    shape: the model's sizes.
    param_dtype: 'bf16' or 'fp32'.
    seq_len: tokens per sequence.
    micro_batch: sequences per device per step (the batch over the data axes).
    remat: activation checkpointing per block.
    attention: 'auto', 'xla' or 'cudnn' (`model.attention`).
    devices: the mesh's device count when every axis is given, else None.
  """

  shape: model_shapes.ModelShape
  param_dtype: str
  seq_len: int
  micro_batch: int
  remat: bool
  attention: str
  devices: int | None


def register(subparsers,
             config_settings: Callable[[str], RunSettings] | None = None) -> None:
  """Adds `plan` to `subparsers`. `config_settings(path)` reads a run config's
  `RunSettings` for `--config`; without it `--config` is refused."""
  p = subparsers.add_parser(
      'plan',
      help='memory per tier, the chosen placement and predicted update times',
      description=__doc__.split('\n\n')[0],
  )
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument('--model', choices=sorted(model_shapes.PRESETS), help='a model size preset')
  what.add_argument('--config', metavar='PATH', help='a run config (YAML) whose model to plan')
  p.add_argument(
      '--profile', default='h100-pcie5',
      help=f'hardware: {", ".join(costmodel.PROFILE_PRESETS)}, {_THIS!r} (calibrate this'
      ' machine, cached), or a profile JSON file (default: h100-pcie5)',
  )
  p.add_argument('--subgroup-size', type=_positive_int, help='elements per subgroup (default: 1e8'
                 ' for models of 1B+ params, smaller below)')
  p.add_argument('--param-dtype', choices=('bf16', 'fp32'),
                 help='parameter dtype (default: bf16, or the config\'s)')
  p.add_argument('--device-memory', type=parse_bytes, help='memory per device (e.g. 80GB)')
  p.add_argument('--host-memory', type=parse_bytes, help='pinned host memory per node (e.g. 1TiB)')
  p.add_argument('--gpus-per-node', type=_positive_int, help='devices sharing a node and its'
                 ' host memory; params, grads and state are sharded over them (default: 4 for'
                 ' the node presets, else 1)')
  p.add_argument('--seq-len', type=_positive_int, help='tokens per sequence (default: 2048,'
                 ' or the config\'s)')
  p.add_argument('--micro-batch', type=_positive_int, help='sequences per device (default: 1,'
                 ' or the config\'s batch over its data axes)')
  p.add_argument('--attention', choices=memory.ATTENTION_KINDS, help='attention kernel whose'
                 ' activations are counted: xla stores the s^2 scores, cudnn (flash) does not'
                 ' (default: cudnn on GPU profiles, xla for this CPU machine, or the config\'s)')
  p.add_argument('--remat', action=argparse.BooleanOptionalAction, help='recompute each'
                 ' block in the backward pass (default: the config\'s model.remat; without a'
                 ' config, on only where the activations would not fit otherwise)')
  p.add_argument('--achieved-tflops', type=_positive_float, help='training TFLOP/s per device,'
                 ' for the forward/backward estimate (default: 200 on h100-pcie5, 100 on'
                 ' a100-pcie4; otherwise no iteration time)')
  p.add_argument('--clip-rate', type=_fraction, default=0.1, metavar='R',
                 help='fraction of steps whose gradients reach the clip norm (a run logs it'
                 ' as offload/rollbacks): what early host calls pay to redo (default: 0.1)')
  p.add_argument('--pipeline', type=_positive_int, default=1, metavar='S',
                 help='pipeline stages: report the GPipe bubble and each stage\'s memory')
  p.add_argument('--microbatches', type=_positive_int, default=1, metavar='M',
                 help='microbatches per step of a pipelined run (default: 1)')
  p.add_argument('--nodes', type=_positive_int, default=1, metavar='N',
                 help='nodes the run spans, each with --gpus-per-node devices; the state'
                 ' is sharded over all of them, and the step counts the gradient'
                 ' reduce-scatter and parameter all-gather over the inter-node link'
                 ' (default: 1)')
  p.add_argument('--internode-gbps', type=_positive_float, metavar='GB/S',
                 help='inter-node link per node, GB/s each way (default: the profile\'s'
                 ' internode_gbps: 50 for h100-pcie5, 400 Gb/s InfiniBand; 25, 200 Gb/s,'
                 ' otherwise)')
  plan_disk.add_arguments(p)
  p.set_defaults(handler=handler, config_settings=config_settings)


def _error(message: str) -> int:
  print(f'{_PROG}: error: {message}', file=sys.stderr)
  return 2


def _load_settings(args) -> RunSettings | None:
  """The run config's settings for `--config`, None for `--model`."""
  if args.model:
    return None
  config_settings = getattr(args, 'config_settings', None)
  if config_settings is None:
    raise ValueError('--config needs the runner\'s config loader; use --model')
  settings = config_settings(args.config)
  if not isinstance(settings, RunSettings):
    raise ValueError(f'{args.config}: the config loader did not return RunSettings')
  return settings


def _resolve(args, settings: RunSettings | None, gpu_profile: bool) -> argparse.Namespace:
  """The flags' values where given, else the config's, else the paper's runs'."""

  def pick(flag, from_config, paper):
    if flag is not None:
      return flag
    return from_config if settings is not None else paper

  attention = pick(args.attention, settings and settings.attention, 'auto')
  if attention == 'auto':
    attention = 'cudnn' if gpu_profile else 'xla'
  return argparse.Namespace(
      shape=settings.shape if settings else model_shapes.preset(args.model),
      param_dtype=pick(args.param_dtype, settings and settings.param_dtype, 'bf16'),
      seq_len=pick(args.seq_len, settings and settings.seq_len, 2048),
      micro_batch=pick(args.micro_batch, settings and settings.micro_batch, 1),
      remat=bool(pick(args.remat, settings and settings.remat, False)),
      attention=attention,
      devices=args.gpus_per_node or (settings.devices if settings else None))


def _load_profile(name: str) -> HardwareProfile:
  if name in costmodel.PROFILE_PRESETS:
    return costmodel.PROFILE_PRESETS[name]
  if name == _THIS:
    from dos_jax.planner import calibrate  # pylint: disable=import-outside-toplevel
    if not os.path.exists(calibrate.profile_path()):
      print(f'calibrating this machine (a few seconds; cached in {calibrate.profile_path()})',
            file=sys.stderr)
    return calibrate.cached_profile()
  if name.endswith('.json'):
    return HardwareProfile.from_json(name)
  raise ValueError(
      f'--profile: unknown profile {name!r}; use {", ".join(costmodel.PROFILE_PRESETS)},'
      f' {_THIS!r} or a .json file'
  )


def _count(n: float) -> str:
  return f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'


Sizing = memory.Sizing
sizing = memory.sizing


class _Refused(ValueError):
  """A flag's value the plan cannot take; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class _Job:
  """What `dos-jax plan` plans: the run (`_resolve`), the machine, and the state."""

  run: argparse.Namespace
  node_profile: HardwareProfile  # The node's (links shared by its devices: `profile`).
  profile: HardwareProfile
  nodes: int
  devices: int  # Per node (a config's mesh counts those of every node).
  param_bytes: int
  state_bytes: int
  size: memory.Sizing
  per_stage: list | None  # `stages.stage_sizes` of a pipelined run.
  spec: SubgroupSpec
  device_mem: float
  host_mem: float | None
  on_disk: bool
  host_cap: float | None  # Host memory per device for the state (with the disk tier).
  tflops: float | None
  fwd: float
  bwd: float


def _job(args, settings: RunSettings | None, profile: HardwareProfile) -> _Job:
  """The run, machine and subgroups `args` describe; `_Refused` for a bad --pipeline."""
  preset_profile = args.profile in costmodel.PROFILE_PRESETS
  # The node presets and JSON profiles describe GPUs; 'this' is this machine.
  gpu_profile = args.profile != _THIS or _this_is_a_gpu()
  run = _resolve(args, settings, gpu_profile)
  shape = run.shape
  nodes = args.nodes
  if args.internode_gbps:
    profile = dataclasses.replace(profile, internode_gbps=args.internode_gbps)
  devices = args.gpus_per_node or (max(1, run.devices // nodes) if run.devices else
                                   (4 if preset_profile else 1))
  param_bytes = 2 if run.param_dtype == 'bf16' else 4
  # bf16: fp32 master + m + v on the host; fp32: the params are the master, m + v.
  state_bytes = 12 if param_bytes == 2 else 8
  # Params, grads and state are sharded over every device of every node.
  size = sizing(shape, param_bytes=param_bytes, state_bytes=state_bytes,
                devices=devices * nodes,
                seq_len=run.seq_len, micro_batch=run.micro_batch, remat=run.remat,
                attention=run.attention)
  per_stage = None
  if args.pipeline > 1:
    from dos_jax.planner import stages  # pylint: disable=import-outside-toplevel
    try:
      per_stage = stages.stage_sizes(
          shape, stages=args.pipeline, microbatches=args.microbatches, devices=devices,
          param_bytes=param_bytes, state_bytes=state_bytes,
          layer_activation_bytes=memory.layer_activation_bytes(
              shape, seq_len=run.seq_len, micro_batch=run.micro_batch,
              attention=run.attention))
    except ValueError as e:
      raise _Refused(f'--pipeline: {e}') from None
  subgroup = args.subgroup_size or (
      int(1e8) if shape.num_params() >= 1e9 else int(1e7) if shape.num_params() >= 1e8 else int(1e6)
  )
  subgroup = min(subgroup, size.num_elements)
  count = math.ceil(size.num_elements / subgroup)
  spec = SubgroupSpec(
      num_subgroups=count, subgroup_size=subgroup,
      num_elements=size.num_elements, state_bytes_per_element=state_bytes,
      param_bytes_per_element=param_bytes, grad_bytes_per_element=param_bytes,
      # The norm scales, packed after the matrices: about the last row.
      decayed_rows=max(count - 1, 1),
  )
  host_mem = plan_disk.host_memory(args, profile)
  on_disk = plan_disk.enabled(args)
  shared = plan_disk.shared(profile, devices)
  tflops = args.achieved_tflops or _DEFAULT_TFLOPS.get(shared.name if preset_profile else '')
  fwd = bwd = 0.0
  if tflops:
    tokens = run.seq_len * run.micro_batch
    fwd = 2 * shape.num_params() * tokens / (tflops * 1e12)
    bwd = 2 * fwd
  return _Job(run=run, node_profile=profile, profile=shared, nodes=nodes, devices=devices,
              param_bytes=param_bytes, state_bytes=state_bytes, size=size,
              per_stage=per_stage, spec=spec,
              device_mem=args.device_memory or profile.device_free_bytes,
              host_mem=host_mem, on_disk=on_disk,
              host_cap=plan_disk.per_device_memory(host_mem, devices) if on_disk else None,
              tflops=tflops, fwd=fwd, bwd=bwd)


def handler(args) -> int:
  try:
    settings = _load_settings(args)
    profile = plan_disk.disk_profile(args, _load_profile(args.profile))
  except ValueError as e:
    return _error(str(e))
  try:
    job = _job(args, settings, profile)
    if args.remat is None and settings is None and job.size.activations > _budget(job):
      acts = job.size.activations
      args = argparse.Namespace(**{**vars(args), 'remat': True})
      job = _job(args, settings, profile)
      print(f'activations ~{_gib(acts)} per device leave no room beside params and grads'
            f' without recomputation: planned with --remat (model.remat: true; --no-remat'
            f' plans without)')
  except _Refused as e:
    return _error(str(e))
  _print_run(args, job)
  chosen, short = _print_memory(args, job)
  if short:
    for line in short:
      print(f'\ndoes not fit: {line}')
    return 1
  plan = chosen.plan
  n = job.spec.num_subgroups
  print(f'\nchosen plan: {plan.describe()} ({len(plan.resident) / n:.0%} resident,'
        f' {len(plan.streamed) / n:.0%} streamed), order: {_order(plan)}')
  plan_table.report(job, plan, budget=_budget(job), last=_last_grad_bytes(job),
                    clip_rate=args.clip_rate, disk_seconds=chosen.prediction.disk_seconds)
  return 0


def _budget(job: _Job) -> float:
  return memory.device_budget(job.device_mem, job.size)


def _last_grad_bytes(job: _Job) -> float:
  """The backward pass makes the input embedding's gradient last: no compute hides its
  copy."""
  shape = job.run.shape
  return auto.last_grad_bytes(shape.vocab_size, shape.dim, job.param_bytes,
                              job.devices * job.nodes)


def _print_run(args, job: _Job) -> None:
  run, spec, nodes = job.run, job.spec, job.nodes
  across = f' x {nodes} nodes' if nodes > 1 else ''
  print(f'model: {args.model or args.config}: {_count(run.shape.num_params())} params'
        f' ({run.param_dtype}), {job.devices} device(s) per node{across},'
        f' {spec.num_subgroups} subgroups of {spec.subgroup_size:,} elements per device')
  print(f'run: sequences of {run.seq_len} tokens, micro-batch {run.micro_batch},'
        f' {run.attention} attention, {"remat" if run.remat else "no remat"}; params, grads'
        f' and state sharded over the {job.devices * nodes} device(s)')
  print(f'profile: {job.profile.name} (device memory {_gib(job.device_mem)}, host memory'
        f' {_gib(job.host_mem) if job.host_mem else "unknown"}'
        f'{plan_disk.profile_note(job.node_profile)})')


def _print_memory(args, job: _Job) -> tuple[auto.Choice, list[str]]:
  """Prints the memory per tier of `Auto`'s plan; returns its choice and what does not
  fit (one line each; none when the run fits)."""
  size, spec, device_mem, host_mem = job.size, job.spec, job.device_mem, job.host_mem
  base = size.params + size.grads
  backward_peak = base + size.activations
  host_state = size.state_per_device * job.devices
  short = []
  if backward_peak > device_mem:
    short.append(f'device memory short by {_gib(backward_peak - device_mem)} per device'
                 f' (params {_gib(size.params)} + grads {_gib(size.grads)} + activations'
                 f' {_gib(size.activations)} > {_gib(device_mem)})')
  if host_mem and host_state > host_mem and not job.on_disk:
    short.append(f'pinned host memory short by {_gib(host_state - host_mem)} per node'
                 f' (optimizer state {_gib(host_state)} > {_gib(host_mem)})')
  budget, acts, profile = _budget(job), size.activations, job.profile
  # The runner's `Auto`, given what the runner gives it: the plan printed is its plan.
  chooser = auto.Auto(profile, budget_bytes=budget, activation_bytes=acts,
                      backward_seconds=job.bwd, last_grad_bytes=_last_grad_bytes(job),
                      host_memory_bytes=job.host_cap)
  chooser.plan(spec)
  chosen = chooser.ranking[0]
  pred = chosen.prediction
  print('\nmemory per tier (chosen plan):')
  print(f'  device (each): params {_gib(size.params)}, grads {_gib(size.grads)}, activations'
        f' ~{_gib(acts)} (fwd/bwd), resident state {_gib(pred.resident_bytes)}, update'
        f' buffers {_gib(pred.buffer_bytes)} -> peak {_gib(base + pred.device_bytes_beside(acts))}'
        f' of {_gib(device_mem)} ({memory.MARGIN:.0%} kept free)')
  on_host = plan_table.host_bytes(job, chosen.plan)
  print(f'  pinned host (node): optimizer state {_gib(on_host)} of {_gib(host_state)}'
        f' ({job.state_bytes} B/param) in {_gib(host_mem) if host_mem else "unknown"}')
  pool = plan_table.pool_bytes(job)
  print(f'  pinned host pool: {pinned_pool.ENV_VAR}={pinned_pool.required_gib(pool)} per'
        f' process, one process per node ({_gib(pool)} for any plan with early host calls'
        f' under clipping, + margin; XLA\'s default is {pinned_pool.DEFAULT_GIB}; dos-jax'
        f' train sets it)')
  if pred.device_bytes_beside(acts) > budget and not short:
    short.append(f'device memory: no plan fits beside the activations (the fastest,'
                 f' {chosen.plan.describe()}, needs {_gib(pred.device_bytes_beside(acts))}'
                 f' beside params and grads, {_gib(budget)} free after the margin)')
  disk_dir = args.disk if args.profile == _THIS else None
  if job.on_disk:
    print('\n'.join(plan_disk.lines(profile, spec, chosen.plan, host_mem, job.devices,
                                    args.disk)))
    short += plan_disk.disk_short(profile, spec, chosen.plan, host_mem, job.devices, disk_dir)
  if job.per_stage:
    from dos_jax.planner import stages  # pylint: disable=import-outside-toplevel
    print()
    print('\n'.join(stages.report(job.per_stage, microbatches=args.microbatches, gib=_gib)))
  return chosen, short


def _this_is_a_gpu() -> bool:
  import jax  # pylint: disable=import-outside-toplevel  # 'this' calibrates with JAX anyway
  return jax.default_backend() == 'gpu'


def _order(plan) -> str:
  if not plan.streamed or not plan.host:
    return 'all in one place'
  first = max(plan.streamed) < min(plan.host)
  return 'streamed subgroups first' if first else 'streamed subgroups spread'
