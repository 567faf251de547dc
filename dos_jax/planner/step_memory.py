"""The memory of one compiled training step, predicted from a run config and a plan.

`predict_step` says what XLA's memory analysis of the runner's one-program step
(`compiled.memory_analysis()`, `dos_jax.dataflow.MemoryStats`) will report, before
anything is traced: the device's peak (arguments + temporaries + outputs that do not
reuse a donated argument) and the host temporaries. It uses `memory.activation_bytes`,
the formula `dos-jax plan` and `dos-jax train`'s check use, and adds what only the
compiled program holds: the token batch, the resident tier, the update phase's buffers,
and on the host the gradient pieces and the host tier's new state.

The device peak is the larger of two moments, which never overlap in the compiled
schedule (the update's device work waits for the clip factor, i.e. for every gradient):

* the start of the backward pass: every layer's activations, the logits and their
  gradient (`memory.activation_bytes`);
* the update phase: the gradients (the host-bound ones are copied out as they are made,
  but the device buffers of the last layers are still live), the device-bound
  gradients packed into rows, `buffers` streamed rows of state, and the new parameter
  rows of every subgroup before they are unpacked into the params.

Checked against the program compiled for an H100 (experiments/memory_vs_compiled.py,
RESULTS.md 2026-11-24): within 10% for the tiny and 125m presets at small scale. Under
ZeRO-3 (`fsdp`) the model keeps its activations batch-split (`train/model.py`), so the
step is the data-parallel one at a device's batch plus the gathered matrices: within
10% of the paper's 7B, 13B and 20B steps at 2 layers, the 20B at 4 and the 125m width
(tests/test_compiled_fsdp.py, RESULTS.md "memory-zero3-activations"). Not modelled: the
float32 split-K partials of GEMMs with few tokens per device in a program compiled
without a GPU (its GEMM configs are not autotuned; the tiny model at 8 sequences of 128,
on one device or four, RESULTS.md), and the whole rows the update gathers when packed
leaf after leaf.
"""

from __future__ import annotations

import dataclasses

from dos_jax.offload import Offload
from dos_jax.planner import costmodel
from dos_jax.planner import memory
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_BYTES = {'float32': 4, 'bfloat16': 2}


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Predicted bytes of one compiled step on one device.

  Attributes:
    arguments: device arguments: params, the token batch, the resident tier's state.
    backward_temp: temporaries at the start of the backward pass (activations).
    update_temp: temporaries during the update phase (gradients, packed rows,
      streamed buffers, new parameter rows).
    host_temp_bytes: host temporaries: the host-bound gradient pieces (and fp32
      params, which are their own master); the state is updated in its own buffer.
  """

  arguments: float
  backward_temp: float
  update_temp: float
  host_temp_bytes: float

  @property
  def device_bytes(self) -> float:
    """The device peak: arguments plus the larger temporary; the outputs (new params and
    state) reuse the donated arguments' buffers. Compare with
    `MemoryStats.device_peak_bytes`."""
    return self.arguments + max(self.backward_temp, self.update_temp)


def packed_rows(shape, subgroup_size: int, shard_multiple: int = 1) -> tuple[int, list[int]]:
  """`(S, elements per row)` of the runner's model packed as `layout.make_layout` packs
  it with the runner's decay mask: the weight-decayed matrices in rows of their own,
  then the norm scales; S capped at the larger block and rounded to `shard_multiple`."""
  decayed = shape.num_params() - (2 * shape.n_layers + 1) * shape.dim
  plain = (2 * shape.n_layers + 1) * shape.dim
  size = min(subgroup_size, max(decayed, plain))
  size = -(-size // shard_multiple) * shard_multiple
  rows = []
  for block in (decayed, plain):
    full, rest = divmod(block, size)
    rows += [size] * full + ([rest] if rest else [])
  return size, rows


def run_spec(cfg, devices: int = 1) -> SubgroupSpec:
  """The `SubgroupSpec` the runner's optimizer builds for `cfg` (one data shard)."""
  shape = cfg.model.shape()
  param_bytes = _BYTES[str(cfg.model.param_dtype)]
  mu_bytes = _BYTES.get(str(cfg.optim.mu_dtype), 4) if cfg.optim.mu_dtype else 4
  size, rows = packed_rows(shape, _subgroup_size(cfg), devices)
  master = 4 if param_bytes < 4 else 0
  decayed = shape.num_params() - (2 * shape.n_layers + 1) * shape.dim
  return SubgroupSpec(num_subgroups=len(rows), subgroup_size=size,
                      num_elements=sum(rows), state_bytes_per_element=master + mu_bytes + 4,
                      param_bytes_per_element=param_bytes, grad_bytes_per_element=param_bytes,
                      decayed_rows=-(-decayed // size))


def _subgroup_size(cfg) -> int:
  if cfg.offload.subgroup_size is not None:
    return cfg.offload.subgroup_size
  return Offload().subgroup_size


def mesh_sizes(cfg, devices: int) -> tuple[int, int, int]:
  """`(data, fsdp, tensor)` of `cfg.mesh` over `devices` (data -1: what the rest leave;
  one device: no split)."""
  if devices <= 1:
    return 1, 1, 1
  mesh = cfg.mesh
  data = mesh.data if mesh.data > 0 else max(
      devices // (mesh.fsdp * mesh.tensor * mesh.pipeline), 1)
  return data, mesh.fsdp, mesh.tensor


def predict_step(cfg, plan: Plan | None = None, devices: int = 1) -> StepMemory:
  """Predicted memory of the runner's compiled step for `cfg` on one device of a mesh
  of `devices` (`cfg.mesh`'s axes; pipeline stages are not modelled).

  Over a mesh: params and gradients split over fsdp x tensor (the norm scales, whole
  everywhere, are neglected), the state over its axis (fsdp with ZeRO-3, else data),
  the batch over data x fsdp; tensor parallelism's split of the activations is not
  modelled. With fsdp, the backward pass also holds gathered matrices in the compute
  dtype (one layer's and its gradient before it is reduce-scattered; without remat every
  layer's, kept from the forward pass).

  Args:
    cfg: a `dos_jax.train.config.RunConfig`.
    plan: the placement; default the configured policy's plan for the packed state
      (give it for `Auto`, whose plan needs a hardware profile).
    devices: the mesh's device count (1: one device, no split).
  """
  shape = cfg.model.shape()
  data, fsdp, tensor = mesh_sizes(cfg, devices)
  state_shards = fsdp if fsdp > 1 else data
  spec = run_spec(cfg, state_shards)
  if plan is None:
    plan = cfg.offload.placement.plan(spec)
  _, rows = packed_rows(shape, spec.subgroup_size, state_shards)
  s, b = cfg.data.seq_len, max(cfg.data.batch_size // (data * fsdp), 1)
  pb = gb = spec.param_bytes_per_element
  sb = spec.state_bytes_per_element
  size = spec.subgroup_size // state_shards  # a row's elements on one device
  n = shape.num_params() // (fsdp * tensor)  # params (and gradients) on one device
  tokens = 4 * b * (s + 1)
  resident = sb * size * len(plan.resident)
  arguments = n * pb + tokens + resident

  compute_bytes = _BYTES[str(cfg.model.compute_dtype)]
  acts = memory.activation_bytes(shape, seq_len=s, micro_batch=b,
                                 compute_bytes=compute_bytes, remat=bool(cfg.model.remat),
                                 attention=cfg.model.attention_impl('gpu'))
  matrices = (shape.num_params() - shape.vocab_size * shape.dim) // tensor
  # The matrices cast to the compute dtype, kept for the backward.
  kept = matrices // fsdp * compute_bytes if pb != compute_bytes else 0
  gathered = 0.0
  if fsdp > 1:
    # Gathered matrices: one layer's and its gradient before the reduce-scatter, and
    # without remat every layer's, which XLA keeps from the forward pass to the backward
    # (the paper's 20B at 4 layers, RESULTS.md 2026-11-26).
    held = 2 if cfg.model.remat else max(2, shape.n_layers)
    gathered = held * matrices // shape.n_layers * compute_bytes
  acts += kept + gathered
  dev_rows = (len(plan.streamed) + len(plan.resident)) * size
  own_master = 0 if pb < 4 else pb  # fp32 params are packed with their gradients
  # Packing the device-bound gradients: the leaves, the flat concatenation and its rows
  # (with no device subgroup nothing is packed, and each leaf dies once copied out).
  packing = (n * gb + 2 * dev_rows * gb) if dev_rows else 0
  packing += dev_rows * own_master + len(plan.host) * size * pb
  # The device loop: its rows, the streamed state it holds at once (`buffers` rows, or
  # every row per subgroup in stream regions), every subgroup's new params.
  streamed, _ = _stream_bytes(spec, plan, size,
                              regions=stream_construction(cfg, plan, devices))
  loop = dev_rows * (gb + own_master) + streamed + spec.num_subgroups * size * pb
  update = max(packing, loop)

  host_elements = sum(rows[i] for i in plan.host) // state_shards
  pulled = gb + (0 if pb < 4 else pb)  # fp32 params are their own master: pulled too
  # The host update writes the state in its argument's buffer (`kernel_calls.host_region_update`):
  # the host temporaries are what it reads, the gradient pieces (and fp32 params).
  host_temp = host_elements * pulled
  return StepMemory(arguments=float(arguments), backward_temp=acts,
                    update_temp=float(update), host_temp_bytes=float(host_temp))


def stream_construction(cfg, plan: Plan, devices: int) -> bool:
  """Whether the runner's step for `cfg` on `devices` devices holds its streamed rows in
  stream regions, as `construction.stream_regions` says of a built state: on one
  device, or for a state packed shard-major over several (the two-memory program
  always is), with host subgroups beside them."""
  del cfg, devices
  return costmodel.regions_by_default(plan)


def _stream_bytes(spec: SubgroupSpec, plan: Plan, size: int, *,
                  regions: bool | None = None) -> tuple[float, int]:
  """`(bytes, rows)`: the device memory the stream holds at once for rows of `size`
  elements (`costmodel.streamed_elements_held`), and how many streamed rows that is
  where they are held in stream regions (0: `buffers` rows of one loop); held row by
  row in the regions, each row also keeps the params it packs there."""
  held = costmodel.streamed_elements_held(plan, [size] * len(plan.streamed),
                                          regions=regions)
  if regions is None:
    regions = costmodel.regions_by_default(plan)
  rows = held // size if regions and plan.streamed else 0
  per_element = spec.state_bytes_per_element + (spec.param_bytes_per_element if rows else 0)
  return float(held * per_element), rows


def stream_shortfall(cfg, plan: Plan, devices, *, device_bytes: float | None = None,
                     regions: bool | None = None) -> str | None:
  """One line when the update phase of `plan` (a run's fixed placement) does not fit the
  device memory left beside params, grads and the margin (`memory.run_budget`): the
  resident state plus the larger of the activations and what the stream holds at once
  (`costmodel.streamed_elements_held`: in stream regions, every streamed row). None
  when it fits, or where the devices are the host.

  `device_bytes` replaces the free memory read from the first device's allocator;
  `regions` is what `construction.stream_regions` says of the run's state (None:
  `stream_construction`'s guess from the config)."""
  need = _stream_need(cfg, plan, devices, device_bytes=device_bytes, regions=regions)
  if need is None or need.fits:
    return None
  stream, rows = need.stream, need.rows
  if rows == len(plan.streamed):
    what = (f'stored per subgroup, the stream holds all {rows} streamed subgroups at once'
            f' ({memory.gib(stream)})')
  else:
    what = f'the stream holds {plan.buffers} rows ({memory.gib(stream)})'
  return (f'offload.policy={cfg.offload.policy}: the update needs {memory.gib(need.total)} of'
          f' device memory beside params and grads ({memory.gib(need.resident)} resident state'
          f' and the larger of the activations, {memory.gib(need.activations)}, and the'
          f' stream: {what}); {memory.gib(need.budget)} is free. Stream fewer subgroups'
          f' (offload.stride, offload.fraction) or let offload.policy: auto size the'
          ' stream')


@dataclasses.dataclass(frozen=True)
class _Need:
  """The update phase's device memory beside params and grads, and what is free."""

  resident: float
  activations: float
  stream: float
  rows: int  # streamed rows held at once in stream regions (0: `buffers` rows)
  budget: float

  @property
  def total(self) -> float:
    return self.resident + max(self.activations, self.stream)

  @property
  def fits(self) -> bool:
    return self.total <= self.budget


def _stream_need(cfg, plan: Plan, devices, *, device_bytes, regions) -> _Need | None:
  """What the update of `plan` needs; None where nothing is checked (the devices are
  the host, or nothing is on the device)."""
  budget = memory.run_budget(cfg, devices, device_bytes)
  if budget is None or not (plan.streamed or plan.resident):
    return None
  budget_bytes, acts = budget
  data, fsdp, _ = mesh_sizes(cfg, len(devices))
  shards = fsdp if fsdp > 1 else data
  spec = run_spec(cfg, shards)
  size = spec.subgroup_size // shards
  if regions is None:
    regions = stream_construction(cfg, plan, len(devices))
  stream, rows = _stream_bytes(spec, plan, size, regions=regions)
  resident = spec.state_bytes_per_element * size * len(plan.resident)
  return _Need(resident=resident, activations=acts, stream=stream, rows=rows,
               budget=budget_bytes)

