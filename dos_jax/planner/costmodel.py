"""The cost model: what one update phase costs on a given machine, for a given plan.

`predict` turns a `HardwareProfile` (see `hardware`), the shape of the packed state
(`SubgroupSpec`) and a `Plan` into a `Prediction` of the update phase.

The model is a roofline over four resources that work at once (host cores, device,
the H2D link, the D2H link). It describes the program `dos_jax.adamw` builds
(`transform`, `paths`, `partition`):

* device subgroups go through a pipeline of `plan.buffers` device buffers: state in
  (H2D), the device AdamW, state out (D2H); row i+1's fetch never waits for row i's
  write-back (checked on the program compiled for an H100). The rows go round-robin
  over min(`buffers`, 2) stream lanes, each a
  stream region running its rows' H2D, AdamW and D2H in turn (XLA runs a region's
  copies one after another), consecutive rows on different streams, so the two
  directions run at once and the steady-state period per subgroup is
  `max(h, c, d, (h + c + d) / buffers)`; one first subgroup's latency fills the
  pipeline.
  In device memory the stream regions hold every streamed row until the regions are done
  (`streamed_elements_held`), within the memory the backward pass frees;
* host subgroups need their gradients D2H, the host AdamW, and their new low-precision
  params H2D. The gradients leave the device piece by piece as the backward pass makes
  them (per leaf, never after a concatenation of all gradients, and never behind the
  global-norm clip, whose factor is applied on the host), so their copies hide behind
  the backward pass as far as it lasts, except the gradient the backward pass makes
  last (`last_grad_bytes`: the runner's model makes its input embedding's gradient
  after its last matmul), which has no compute left to hide behind: so the program
  compiled for an H100 schedules it (RESULTS.md, 2026-11-24); fp32 params, which are
  their own master, go along (they exist before the backward pass);
* the two paths run concurrently: the host tier and the streamed tier are separate
  arrays, and no value flows from the host region to the device stream or back within
  a step, so XLA runs the host region's asynchronous start/done pair alongside the
  device loop (in the compiled schedule: in 11 of 13 programs checked, RESULTS.md,
  2026-11-24; the others run the two in turn). The host AdamW runs
  `host_copy_slowdown` times slower while the device stream's copies run (they share
  host memory bandwidth);
* assembling the device subgroups' gradient rows before the stream, and unpacking the
  new rows into the params after, cost device-memory traffic (`layout_bytes`) outside
  both paths; the host subgroups' rows are assembled in host memory;
* host subgroups whose state is on disk (`planner.disk`) are updated by a host call of
  their own after the others, whose time `disk.predict` adds to the host path;
* the update phase lasts as long as the slowest path or link. On a machine whose
  "device" is the host itself (`device_is_host`, the CPU backend) `dos_jax` builds the
  CPU program: every subgroup, whatever the plan, is updated by the same host call,
  and nothing is copied, so every plan costs the host AdamW over all elements.

With a fast device and the state copies hidden, this reduces to the paper's rule
(docs/planner.md, the paper's method, point 6): one device subgroup in every k hides behind the host
work on the other k-1 when (k-1)/U_host >= 12/B, i.e. k >= 1 + 12 U_host / B.
"""

from __future__ import annotations

import dataclasses

# The profile lives in `hardware`; re-exported so callers need one import.
from dos_jax.planner.hardware import A100_PCIE_GEN4_NODE as A100_PCIE_GEN4_NODE
from dos_jax.planner.hardware import ADAMW_BYTES_PER_PARAM as ADAMW_BYTES_PER_PARAM
from dos_jax.planner.hardware import H100_PCIE_GEN5_NODE as H100_PCIE_GEN5_NODE
from dos_jax.planner.hardware import HardwareProfile as HardwareProfile
from dos_jax.planner.hardware import PROFILE_PRESETS as PROFILE_PRESETS
# The inter-node collectives live in `internode`; re-exported likewise.
from dos_jax.planner.internode import Internode as Internode
from dos_jax.planner.internode import internode as internode
# What the stream holds in device memory lives in `stream_memory`; re-exported likewise.
from dos_jax.planner.stream_memory import regions_by_default as regions_by_default
from dos_jax.planner.stream_memory import streamed_elements_held as streamed_elements_held
from dos_jax.policies import Plan
from dos_jax.policies import SubgroupSpec

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The predicted update phase of one plan.

  Attributes:
    update_seconds: the whole update phase (after the backward pass).
    device_stream_seconds: the device path alone (copies in, device AdamW, copies out).
    host_seconds: the host path alone (exposed gradient copies, host AdamW slowed by
      the copies it competes with, params back to the device).
    bytes_h2d: bytes moved host -> device (device subgroups' state, host subgroups'
      new low-precision params).
    bytes_d2h: bytes moved device -> host (device subgroups' state, host subgroups'
      gradients, including those hidden behind the backward pass).
    grad_transfer_hidden_seconds: how much of the host subgroups' gradient copies
      hides behind the backward pass.
    device_peak_bytes: device memory the update needs beyond params and grads: the
      resident tier's state plus the streamed path's buffers.
    bound: what limits the update: 'device stream', 'host', 'host + disk', 'H2D link',
      'D2H link', 'resident' or 'serialized' (device_is_host).
    layout_seconds: packing gradients (and fp32 params) into subgroup rows before the
      paths run, and unpacking the new rows into updates applied to the params after;
      part of `update_seconds`.
    disk_seconds: the disk subgroups' host call, on the host path after the others
      (`planner.disk`); 0 without a disk tier.
  """

  update_seconds: float
  device_stream_seconds: float
  host_seconds: float
  bytes_h2d: float
  bytes_d2h: float
  grad_transfer_hidden_seconds: float
  device_peak_bytes: float
  bound: str
  layout_seconds: float = 0.0
  resident_bytes: float = 0.0
  disk_seconds: float = 0.0

  @property
  def buffer_bytes(self) -> float:
    """Device memory the update needs only while it runs (the streamed buffers); the
    resident state (`resident_bytes`) stays through the forward and backward passes."""
    return self.device_peak_bytes - self.resident_bytes

  def device_bytes_beside(self, activation_bytes: float) -> float:
    """Device memory beyond params and grads over a whole iteration: the resident
    state always, plus the larger of the activations (forward/backward) and the
    streamed buffers (update phase), which never coexist."""
    return self.resident_bytes + max(activation_bytes, self.buffer_bytes)


@dataclasses.dataclass(frozen=True)
class IterationPrediction:
  """A whole training iteration: forward + backward + the predicted update phase."""

  forward_seconds: float
  backward_seconds: float
  update: Prediction

  @property
  def iteration_seconds(self) -> float:
    return self.forward_seconds + self.backward_seconds + self.update.update_seconds


def subgroup_sizes(spec: SubgroupSpec) -> list[int]:
  """Elements each subgroup's update processes: the core updates every row at full size,
  padding included (a layout pads the weight-decayed block and the rest separately, so
  up to two rows are partly padding)."""
  n, size = spec.num_subgroups, spec.subgroup_size
  if n < 1 or size < 1 or not 0 < spec.num_elements <= n * size:
    raise ValueError(
        f'inconsistent SubgroupSpec: {spec.num_elements} elements in {n} subgroups of {size}'
    )
  return [size] * n


def master_kept(spec: SubgroupSpec) -> bool:
  """Whether the host state holds a separate fp32 master copy: it does when the params
  are below fp32; fp32 params are their own master and stay on the device."""
  return spec.param_bytes_per_element < 4


def host_pull_bytes(spec: SubgroupSpec) -> int:
  """Bytes per element a host subgroup pulls device -> host: its gradients, and its
  params too when no master copy lives on the host."""
  extra = 0 if master_kept(spec) else spec.param_bytes_per_element
  return spec.grad_bytes_per_element + extra


def layout_bytes(spec: SubgroupSpec, device_fraction: float = 1.0) -> float:
  """Device-memory traffic per element around the two paths: the device subgroups'
  gradients assembled into rows (read + write; `device_fraction` of the elements), fp32
  params likewise when they are the master, the output rows initialized, and the new
  rows unpacked into updates that `optax.apply_updates` adds to the params (read row
  and param, write param)."""
  pb, gb = spec.param_bytes_per_element, spec.grad_bytes_per_element
  params_packed = 0 if master_kept(spec) else 2 * pb
  return device_fraction * (2 * gb + params_packed) + pb + 3 * pb


def _slowed(work: float, window: float, slowdown: float) -> float:
  """Time for `work` seconds of host compute when it runs `slowdown` times slower
  during the first `window` seconds (while copies run) and at full speed after."""
  if work * slowdown <= window:
    return work * slowdown
  return window + (work - window / slowdown)


def stream_seconds(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan,
                   dev_sizes: list[int], *, both: bool = True) -> float:
  """The streamed path of `dev_sizes` (rows of `plan`'s stream, in order) alone, from
  the first fetch to the last write-back (see the module docstring); `both`: the two
  link directions carry traffic at once."""
  if not dev_sizes:
    return 0.0
  sb = spec.state_bytes_per_element
  u_dev = profile.device_adamw_gparams * _GB
  h2d_bw = (profile.both_gbps if both else profile.h2d_gbps) * _GB
  d2h_bw = (profile.both_gbps if both else profile.d2h_gbps) * _GB
  stream = 0.0
  # A single buffer cannot overlap its own copies: those run at the lone-direction rate.
  in_bw = h2d_bw if plan.buffers >= 2 else profile.h2d_gbps * _GB
  out_bw = d2h_bw if plan.buffers >= 2 else profile.d2h_gbps * _GB
  latencies = []
  for s in dev_sizes:
    h, c, d = sb * s / in_bw, s / u_dev, sb * s / out_bw
    period = max(h, c, d, (h + c + d) / plan.buffers)
    stream += period
    latencies.append((h + c + d) - period)
  if latencies:
    stream += max(latencies[0], 0.0)  # filling the pipeline: the first subgroup's latency
  return stream


def predict(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    *,
    backward_seconds: float = 0.0,
    last_grad_bytes: float = 0.0,
    disk_subgroups: tuple[int, ...] = (),
    disk_seconds: float = 0.0,
) -> Prediction:
  """Predicts the update phase of `plan` on `profile` (see the module docstring).

  Args:
    profile: the machine.
    spec: the packed state (subgroup count and size, bytes per element).
    plan: which subgroups go where.
    backward_seconds: length of the backward pass, during which the host subgroups'
      gradient copies can already run (0: nothing hides).
    last_grad_bytes: bytes of the gradient the backward pass makes after its last
      matmul (the runner's model: the input embedding's); its host-bound share (the
      host subgroups' share of the elements) leaves the device with nothing to hide
      behind.
    disk_subgroups, disk_seconds: host subgroups whose state is on disk, and their own
      host call's time, which follows the in-memory host work (`planner.disk.predict`).
  """
  if plan.num_subgroups != spec.num_subgroups:
    raise ValueError(
        f'plan names {plan.num_subgroups} subgroups but the spec has {spec.num_subgroups}'
    )
  sizes = subgroup_sizes(spec)
  disk_elements = sum(sizes[i] for i in disk_subgroups)
  if profile.device_is_host:
    return _predict_one_memory(profile, spec, sizes, disk_elements, disk_seconds)
  sb = spec.state_bytes_per_element
  gb = host_pull_bytes(spec)
  u_dev = profile.device_adamw_gparams * _GB
  on_device = plan.streamed + plan.resident
  device_fraction = sum(sizes[i] for i in on_device) / max(1, sum(sizes))
  layout = (spec.num_elements * layout_bytes(spec, device_fraction)
            / (profile.device_memory_gbps * _GB))
  resident_bytes = float(sb * sum(sizes[i] for i in plan.resident))
  # Resident subgroups are updated in device memory with no copies; their update
  # shares the device with the stream's, so the device path does both in turn.
  resident_seconds = sum(sizes[i] for i in plan.resident) / u_dev
  if plan.all_resident:
    return _predict_all_resident(spec.num_elements / u_dev, layout, resident_bytes)

  dev_sizes = [sizes[i] for i in plan.streamed]
  host_elements = sum(sizes[i] for i in plan.host)
  # Both directions carry traffic at once only when the device stream overlaps.
  both = bool(dev_sizes) and (plan.buffers >= 2 or bool(plan.host))
  h2d_bw = (profile.both_gbps if both else profile.h2d_gbps) * _GB
  d2h_bw = (profile.both_gbps if both else profile.d2h_gbps) * _GB

  stream_alone = stream_seconds(profile, spec, plan, dev_sizes, both=both)
  stream = stream_alone + resident_seconds

  grad_seconds = gb * host_elements / d2h_bw
  last_seconds = max(last_grad_bytes, 0.0) * host_elements / sum(sizes) / d2h_bw
  hidden = max(min(grad_seconds - last_seconds, backward_seconds), 0.0)
  host = _host_seconds(profile, spec, plan, sizes, exposed=grad_seconds - hidden,
                       stream=stream_alone, h2d_bw=h2d_bw, disk_elements=disk_elements,
                       disk_seconds=disk_seconds)

  bytes_h2d = float(sb * sum(dev_sizes) + spec.param_bytes_per_element * host_elements)
  bytes_d2h = float(sb * sum(dev_sizes) + gb * host_elements)
  h2d_link = (bytes_h2d) / h2d_bw
  d2h_link = (bytes_d2h - gb * host_elements * (hidden / grad_seconds if grad_seconds else 0)) / d2h_bw
  device_label = 'device stream' if dev_sizes else 'resident'
  update, bound = max(
      (stream, device_label), (host, 'host + disk' if disk_seconds else 'host'),
      (h2d_link, 'H2D link'), (d2h_link, 'D2H link'),
      key=lambda item: item[0],
  )
  peak = float(sb * streamed_elements_held(plan, dev_sizes))
  return Prediction(
      update_seconds=update + layout, device_stream_seconds=stream, host_seconds=host,
      bytes_h2d=bytes_h2d, bytes_d2h=bytes_d2h, grad_transfer_hidden_seconds=hidden,
      device_peak_bytes=peak + resident_bytes, bound=bound, layout_seconds=layout,
      resident_bytes=resident_bytes, disk_seconds=disk_seconds,
  )


def _predict_one_memory(profile: HardwareProfile, spec: SubgroupSpec, sizes: list[int],
                        disk_elements: int, disk_seconds: float) -> Prediction:
  """The CPU program: one host call over every subgroup, whatever the plan; it reads
  the gradient leaves in place, so only the unpacking remains outside it."""
  u_host = profile.host_adamw_gparams() * _GB
  seconds = (sum(sizes) - disk_elements) / u_host + disk_seconds
  layout = spec.num_elements * layout_bytes(spec, 0.0) / (profile.device_memory_gbps * _GB)
  return Prediction(
      update_seconds=seconds + layout, device_stream_seconds=0.0, host_seconds=seconds,
      bytes_h2d=0.0, bytes_d2h=0.0, grad_transfer_hidden_seconds=0.0,
      device_peak_bytes=0.0, bound='serialized', layout_seconds=layout,
      disk_seconds=disk_seconds,
  )


def _host_seconds(profile: HardwareProfile, spec: SubgroupSpec, plan: Plan, sizes: list[int],
                  *, exposed: float, stream: float, h2d_bw: float, disk_elements: int,
                  disk_seconds: float) -> float:
  """The host path of `plan` (0 without host subgroups): the gradients' `exposed` copy
  seconds, the host AdamW (slowed while the `stream` seconds of device copies run), the
  new params back at `h2d_bw`, and the disk subgroups' own call."""
  if not plan.host:
    return 0.0
  pb = spec.param_bytes_per_element
  host_elements = sum(sizes[i] for i in plan.host)
  param_seconds = pb * host_elements / h2d_bw
  work = (host_elements - disk_elements) / (profile.host_adamw_gparams() * _GB)
  compute = _slowed(work, stream, profile.host_copy_slowdown)
  first, last = sizes[plan.host[0]], sizes[plan.host[-1]]
  # The first subgroup's exposed gradients must arrive before its update starts, and
  # the last one's params go back after it ends; the rest pipelines.
  fill = exposed * first / host_elements
  drain = pb * last / h2d_bw
  return fill + max(exposed, compute, param_seconds) + disk_seconds + drain


@dataclasses.dataclass(frozen=True)
class Migration:
  """What moving from one plan's tiers to another's costs, once.

  Attributes:
    subgroups: subgroups whose tier changes.
    bytes_h2d: state bytes copied host -> device (rows becoming resident).
    bytes_d2h: state bytes copied device -> host (rows leaving the resident tier).
    seconds: the predicted time of those copies (the two links in parallel).
  """

  subgroups: int
  bytes_h2d: float
  bytes_d2h: float
  seconds: float


def _placement_of(plan: Plan) -> dict[int, str]:
  out = {g: 'host' for g in plan.host}
  out.update({g: 'streamed' for g in plan.streamed})
  out.update({g: 'resident' for g in plan.resident})
  return out


def migration(profile: HardwareProfile, spec: SubgroupSpec, old: Plan, new: Plan) -> Migration:
  """The one-off cost of moving the state's rows from `old`'s tiers to `new`'s.

  Rows that become resident cross H2D and rows that leave the resident tier cross D2H.
  Each row is its own buffer (the two-memory program's storage), so a row moving
  between the two host tiers (host <-> streamed, both in pinned host memory) keeps its
  buffer and costs nothing, and the order within a tier does not matter.
  """
  before, after = _placement_of(old), _placement_of(new)
  sizes = subgroup_sizes(spec)
  sb = spec.state_bytes_per_element
  moved = [g for g in after if before.get(g) != after[g]]
  h2d = float(sum(sb * sizes[g] for g in moved if after[g] == 'resident'))
  d2h = float(sum(sb * sizes[g] for g in moved if before[g] == 'resident'))
  if profile.device_is_host:
    seconds = (h2d + d2h) / (profile.device_memory_gbps * _GB)
  else:
    seconds = max(h2d / (profile.h2d_gbps * _GB), d2h / (profile.d2h_gbps * _GB))
  return Migration(subgroups=len(moved), bytes_h2d=h2d, bytes_d2h=d2h, seconds=seconds)


def _predict_all_resident(seconds: float, layout: float, resident_bytes: float) -> Prediction:
  """Every subgroup resident: the device updates the state in place, no copies."""
  return Prediction(
      update_seconds=seconds + layout, device_stream_seconds=seconds, host_seconds=0.0,
      bytes_h2d=0.0, bytes_d2h=0.0, grad_transfer_hidden_seconds=0.0,
      device_peak_bytes=resident_bytes, bound='resident', layout_seconds=layout,
      resident_bytes=resident_bytes,
  )


def predict_iteration(
    profile: HardwareProfile,
    spec: SubgroupSpec,
    plan: Plan,
    *,
    forward_seconds: float = 0.0,
    backward_seconds: float = 0.0,
    last_grad_bytes: float = 0.0,
) -> IterationPrediction:
  """A whole iteration: the given forward and backward times plus the update phase,
  with the host subgroups' gradient copies hidden behind the backward pass (all but
  `last_grad_bytes`, see `predict`)."""
  update = predict(profile, spec, plan, backward_seconds=backward_seconds,
                   last_grad_bytes=last_grad_bytes)
  return IterationPrediction(forward_seconds, backward_seconds, update)
