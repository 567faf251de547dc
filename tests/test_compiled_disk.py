"""The disk tier in the two-memory program, compiled for an H100 with no GPU.

The CUDA plugin takes the disk kernel's handler (registered in its own FFI registry and
probed by `dataflow.compile.prepare`, `kernels.plugin_kernel`), and the construction
holds with a disk tier: the disk call is a host call in the scheduling group of the
device tiers' stream lanes, so the device update runs beside it. Over a family of shapes
(every host subgroup on disk; some in memory and the rest on disk, the two then one
host call) and under the option sets a user may pass (`test_compiled_options.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dos_jax import lowering as lowering_lib
import dos_jax
from dos_jax import dataflow
from dos_jax.dataflow import hlo
from tests.tooling import probes
from dos_jax.kernels import host_adamw_disk
from tests import compiled
from tests.test_compiled_options import OPTIONS

pytestmark = pytest.mark.compiled_gpu

compiled.skip_without_gpu_compiler()

if not host_adamw_disk.disk_kernel_available():
  pytest.skip('the native disk kernel is not built', allow_module_level=True)

_TARGET = host_adamw_disk._TARGET  # pylint: disable=protected-access


def _disk_step(tmp_path, layers: int, width: int, dtype: str, policy, in_memory: int):
  """A donated, clipped train step of an L x W MLP (one subgroup per layer) whose host
  subgroups beyond `in_memory` keep their state on disk, with its arguments."""
  params = jax.device_put(probes.mlp_params(layers, width, jnp.dtype(dtype)),
                          jax.devices()[0])
  size = width * width + width
  row_bytes = (2 if jnp.dtype(dtype) == jnp.float32 else 3) * 4 * size
  disk = dos_jax.Disk(str(tmp_path / 'state'), host_state_bytes=in_memory * row_bytes)
  opt = dos_jax.chain(dos_jax.clip_by_global_norm(1.0), dos_jax.adamw(
      1e-3, offload=dos_jax.Offload(subgroup_size=size, policy=policy, disk=disk),
      implementation=dos_jax.Implementation(program='gpu')))
  state = opt.init(params)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, width)), jnp.dtype(dtype))

  def step(p, s, x):
    loss, g = jax.value_and_grad(probes.mlp_loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  return step, (params, state, x)


def _disk_calls(program) -> list:
  """The host calls whose computations call the disk kernel."""
  module = hlo.Module.parse(program.hlo_text)
  entry = module.entry_computation.by_name()
  return [c for c in program.schedule.host_calls
          if any(i.opcode == 'custom-call' and _TARGET in (i.attribute('custom_call_target') or '')
                 for n in entry[c.name].called for comp in module.reachable(n)
                 for i in comp.instructions)]


def _assert_lanes_beside(schedule, disks) -> None:
  """Every device update beside a host call, the disk calls among them: on jax 0.11 one
  disk call with every stream lane in its window (one group); on the staged lowering
  (`dos_jax.step.stages`) the disk update split into as many calls as the stages need
  (`Construction.disk_calls`), the last host calls, each overlapping its stage's lanes."""
  lanes = [s for s in schedule.stream_calls if s.updates]
  if lowering_lib.of_version() is lowering_lib.Lowering.IN_REGION:
    (disk,) = disks
    assert all(s.overlaps(disk) for s in lanes), (disk, lanes)
  else:
    assert list(schedule.host_calls[-len(disks):]) == disks, (disks, schedule.host_calls)
    assert all(any(s.overlaps(d) for s in lanes) for d in disks), (disks, lanes)
  assert not schedule.device_updates_outside_host_calls(), (schedule.host_calls, lanes)


# (layers, width, dtype, policy, host subgroups whose state stays in memory)
FAMILY = (
    (6, 512, 'bfloat16', dos_jax.Stride(2), 0),
    (7, 384, 'float32', dos_jax.DeviceFraction(0.5), 2),
)


@pytest.mark.parametrize('options', list(OPTIONS))
@pytest.mark.parametrize('layers, width, dtype, policy, in_memory', FAMILY,
                         ids=lambda v: str(v))
def test_the_disk_call_runs_beside_the_device_tiers(tmp_path, layers, width, dtype, policy,
                                                     in_memory, options):
  assert dataflow.compile.prepare()
  assert host_adamw_disk.register_for_gpu_compile() == (True, '')
  fn, args = _disk_step(tmp_path, layers, width, dtype, policy, in_memory)
  is_state = lambda x: isinstance(x, dos_jax.OffloadedState)
  state = next(x for x in jax.tree.leaves(args[1], is_leaf=is_state) if is_state(x))
  assert state.partition.disk and len(state.partition.host) == in_memory
  ours = options == 'gpu_compiler_options'
  program = dataflow.compile_for_gpu(fn, *args, compiler_options=OPTIONS[options],
                                     early_windows=ours, donate_argnums=(0, 1))
  schedule = program.schedule
  disks = _disk_calls(program)  # the disk calls, in host computations
  assert disks and schedule.device_updates_on_streams() >= 1, schedule.stream_calls
  if ours:
    _assert_lanes_beside(schedule, disks)
  elif options == 'lhs_alone':  # the group: a disk call beside the first lane
    assert any(s.overlaps(d) for s in schedule.stream_calls for d in disks), (
        disks, schedule.stream_calls)


@pytest.mark.parametrize('host_state_gib', [0.001, 0.0], ids=['one-in-memory', 'all-on-disk'])
def test_the_runners_zero3_step_runs_each_devices_lanes_beside_its_disk_call(
    tmp_path, host_state_gib):
  """The runner's step on mesh.fsdp=4 (the state shard-major, each device its own
  files), compiled for 4 H100s under `GPU_COMPILER_OPTIONS`: each device's disk call is
  the host call of its stream lanes' group (`lanes.sharded_two_streams`), so every
  device update runs beside it, with every host subgroup on disk or one in memory."""
  from dos_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(None, [
      'offload.policy=stride', 'model.param_dtype=bfloat16', 'offload.subgroup_size=65536',
      'optim.clip_norm=1.0', 'mesh.fsdp=4', f'offload.disk_dir={tmp_path / "state"}',
      f'offload.host_state_gib={host_state_gib}'])
  program = compiled.compile_step(cfg, devices=jax.devices()[:4])
  schedule = program.schedule
  disks = _disk_calls(program)
  assert disks and schedule.device_updates_on_streams() >= 1, schedule.stream_calls
  _assert_lanes_beside(schedule, disks)
