"""Renamed public names (issue 30): the new names are what `dos_jax` exports, and the old
ones keep working for one release with a `DeprecationWarning` naming the new one.

- `Plan.device` -> `Plan.streamed` (the streamed tier's subgroups; `Tier.STREAMED`).
- `dos_jax.Platform` (`CPU`, `GPU`) -> `dos_jax.Program` (`ONE_MEMORY`, `TWO_MEMORIES`):
  what it picks is the program, with one memory or with host and device memory apart.
- `dos_jax.Layout`, `dos_jax.spec_for` -> `dos_jax.geometry.layout`; `dos_jax.Partition`,
  `dos_jax.Tier` -> `dos_jax.geometry.partition`: the state's internals, no longer exported.
"""

import dataclasses
import pickle
import warnings

import pytest

import dos_jax
from dos_jax.geometry import layout as layout_lib
from dos_jax import offload as offload_lib
from dos_jax.geometry import partition as partition_lib

# Pickled (protocol 2) by the release before the renames: `pickle.dumps(dos_jax.Plan(
# device=(0, 2), host=(1, 3), buffers=3), protocol=2)` and `pickle.dumps(
# dos_jax.Platform.GPU, protocol=2)`.
OLD_PLAN_PICKLE = (
    b'\x80\x02cdos_jax.policies\nPlan\nq\x00)\x81q\x01}q\x02(X\x06\x00\x00\x00deviceq\x03K'
    b'\x00K\x02\x86q\x04X\x04\x00\x00\x00hostq\x05K\x01K\x03\x86q\x06X\x08\x00\x00\x00resid'
    b'entq\x07)X\x07\x00\x00\x00buffersq\x08K\x03ub.')
OLD_PLATFORM_PICKLE = (
    b'\x80\x02cdos_jax.offload\nPlatform\nq\x00X\x03\x00\x00\x00gpuq\x01\x85q\x02Rq\x03.')


def test_dos_jax_exports_the_new_names():
  assert dos_jax.Program is offload_lib.Program
  assert 'Program' in dir(dos_jax) and 'Platform' not in vars(dos_jax)
  assert list(dos_jax.Program) == [dos_jax.Program.ONE_MEMORY, dos_jax.Program.TWO_MEMORIES]
  assert [f.name for f in dataclasses.fields(dos_jax.Plan)] == [
      'streamed', 'host', 'resident', 'buffers']
  with pytest.raises(AttributeError, match='NoSuchName'):
    dos_jax.NoSuchName  # pylint: disable=pointless-statement


def test_the_new_names_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    plan = dos_jax.Plan(streamed=(0, 2), host=(1,), resident=(3,))
    assert plan.streamed == (0, 2) and dos_jax.Plan((0, 2), (1,), (3,)) == plan
    assert dos_jax.Stride(2).plan(dos_jax.SubgroupSpec(4, 10, 40)).streamed == (0, 2)
    assert dos_jax.Offload(platform='gpu').platform is dos_jax.Program.TWO_MEMORIES
    assert dos_jax.Offload(platform='cpu').platform is dos_jax.Program.ONE_MEMORY
    assert dos_jax.Program.of_backend('cpu') is dos_jax.Program.ONE_MEMORY
    assert dos_jax.Program.of_backend('cuda') is dos_jax.Program.TWO_MEMORIES


def test_plan_device_keyword_and_attribute_warn_and_mean_streamed():
  with pytest.warns(DeprecationWarning, match='Plan.streamed'):
    old = dos_jax.Plan(device=(0, 2), host=(1,), buffers=3)
  assert old == dos_jax.Plan(streamed=(0, 2), host=(1,), buffers=3)
  with pytest.warns(DeprecationWarning, match='Plan.streamed'):
    assert old.device == (0, 2)
  with pytest.raises(TypeError, match='streamed= only'):
    dos_jax.Plan(streamed=(0,), device=(0,), host=())
  with pytest.raises(TypeError, match='streamed= and host='):
    dos_jax.Plan(host=(0,))


def test_a_plan_pickled_before_the_rename_loads_and_a_new_one_writes_streamed():
  plan = pickle.loads(OLD_PLAN_PICKLE)
  assert plan == dos_jax.Plan(streamed=(0, 2), host=(1, 3), buffers=3)
  assert plan.streamed == (0, 2) and hash(plan) == hash(dos_jax.Plan((0, 2), (1, 3), (), 3))
  new = pickle.dumps(plan, protocol=2)
  assert b'streamed' in new and b'device' not in new
  assert pickle.loads(new) == plan


def test_platform_warns_and_is_program():
  with pytest.warns(DeprecationWarning, match='dos_jax.Program'):
    platform = dos_jax.Platform
  assert platform.GPU is dos_jax.Program.TWO_MEMORIES
  assert platform.CPU is dos_jax.Program.ONE_MEMORY
  assert platform('gpu') is dos_jax.Program.TWO_MEMORIES
  assert dos_jax.Offload(platform=platform.GPU).platform is dos_jax.Program.TWO_MEMORIES
  assert dos_jax.Offload(platform=platform.CPU).target() is platform.CPU
  with pytest.warns(DeprecationWarning, match='dos_jax.Program'):
    from dos_jax.offload import Platform  # pylint: disable=import-outside-toplevel
  assert Platform is dos_jax.Program


def test_a_platform_pickled_before_the_rename_loads_as_its_program():
  with pytest.warns(DeprecationWarning, match='dos_jax.Program'):
    assert pickle.loads(OLD_PLATFORM_PICKLE) is dos_jax.Program.TWO_MEMORIES


def test_offload_platform_refuses_other_strings():
  with pytest.raises(ValueError, match="dos_jax.Program, 'cpu' or 'gpu'"):
    dos_jax.Offload(platform='tpu')


@pytest.mark.parametrize('name, module', [
    ('Layout', layout_lib), ('spec_for', layout_lib),
    ('Partition', partition_lib), ('Tier', partition_lib)])
def test_the_state_internals_left_the_public_names_and_warn(name, module):
  assert name not in vars(dos_jax)
  with pytest.warns(DeprecationWarning, match=f'use {module.__name__}.{name}'):
    old = getattr(dos_jax, name)
  assert old is getattr(module, name)


def test_the_moved_names_still_import_with_a_warning():
  with pytest.warns(DeprecationWarning, match='dos_jax.geometry.partition.Tier'):
    from dos_jax import Tier  # pylint: disable=import-outside-toplevel
  assert Tier.HOST is partition_lib.Tier.HOST


@pytest.mark.parametrize('name', [
    'geometry.layout', 'geometry.slots', 'geometry.partition', 'geometry.state',
    'step.transform', 'step.tier_updates', 'step.paths', 'step.fused', 'step.chunked',
    'step.early_chunks', 'step.device_stream'])
def test_moved_modules_keep_their_old_names_for_one_release(name):
  """`dos_jax.<m>` moved to `dos_jax.geometry.<m>` or `dos_jax.step.<m>`; the old
  import warns and is the same module (its private names included)."""
  import importlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  moved = importlib.import_module(f'dos_jax.{name}')
  name = name.split('.')[1]
  sys.modules.pop(f'dos_jax.{name}', None)
  with pytest.warns(DeprecationWarning, match=f'dos_jax.(geometry|step).{name}'):
    old = importlib.import_module(f'dos_jax.{name}')
  assert old is moved
