"""Tests of the native disk AdamW (kernels/host_adamw_disk.cc) against the in-memory
row kernel, `adamw_host_rows`, on the same state: bit for bit, since both run the same
row loop (adamw_rows.h). That kernel is itself held to jit(optax.adamw) bit for bit
(test_kernels_host_rows.py)."""

from __future__ import annotations

import doctest
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import kernels
from dos_jax.kernels import host_adamw_disk as disk
from dos_jax.kernels.host_adamw_rows import adamw_host_rows
from dos_jax.kernels.host_adamw_rows import rows_kernel_available
from tests.test_kernels_host_rows import random_stacked
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import step_scalars

pytestmark = pytest.mark.skipif(
    not (disk.disk_kernel_available() and rows_kernel_available()),
    reason=f'not available: {disk.disk_kernel_unavailable_reason() or "row kernel missing"}')

MASTER = (0, 2, 1)  # (master_k, mu_k, nu_k): not the natural order, to catch mix-ups
NO_MASTER = (-1, 1, 0)


class Memory:
  """The reference: the same state as the files, held as a stacked (G, K, S) array and
  updated by `adamw_host_rows` on rows `subgroups` (decay is by subgroup id in both)."""

  def __init__(self, rng, subgroups, size, slots, directory):
    self.subgroups, self.slots = list(subgroups), slots
    self.stacked = random_stacked(rng, max(subgroups) + 1, size, slots)
    for g in subgroups:
      disk.write_state(directory, g, 0, self.stacked[g])

  def step(self, grads, params, scalars, **kw):
    stacked, out = adamw_host_rows(
        jnp.asarray(self.stacked), grads, params, jnp.asarray(self.subgroups, jnp.int32),
        scalars, slots=self.slots, **kw)
    self.stacked = np.asarray(stacked)
    return np.asarray(out)


def _setup(seed, tmp_path, master: bool, rows: int = 4):
  rng = np.random.default_rng(seed)
  size = int(rng.integers(1000, 5000))
  # Non-consecutive ids, and a decay boundary between two of them.
  subgroups = sorted(rng.choice(40, rows, replace=False).tolist())
  decayed_rows = subgroups[rows // 2]
  slots = MASTER if master else NO_MASTER
  memory = Memory(rng, subgroups, size, slots, str(tmp_path))
  return rng, size, subgroups, decayed_rows, slots, memory


def _draw(rng, rows, size, grad_dtype, master):
  grads = jnp.asarray(rng.standard_normal((rows, size)) * 1e-2, grad_dtype)
  params = None if master else jnp.asarray(rng.standard_normal((rows, size)), jnp.float32)
  return grads, params


def _file_bytes(directory, g, parity) -> bytes:
  with open(disk.state_path(directory, g, parity), 'rb') as f:
    return f.read()


@pytest.mark.parametrize('master, grad_dtype, nesterov, direct_io', [
    (True, jnp.bfloat16, False, True),
    (True, jnp.float32, True, False),
    (False, jnp.float32, False, True),
    (False, jnp.bfloat16, True, True),
], ids=['master-bf16grads', 'master-f32grads-nesterov-buffered', 'fp32params-f32grads',
        'fp32params-bf16grads-nesterov'])
def test_steps_match_the_row_kernel_bit_for_bit(seed, tmp_path, master, grad_dtype,
                                                nesterov, direct_io):
  rng, size, subgroups, decayed_rows, slots, memory = _setup(seed, tmp_path, master)
  directory, k = str(tmp_path), memory.stacked.shape[1]
  lowp = jnp.bfloat16 if master else jnp.float32
  hyper = Hyper(nesterov=nesterov)
  gen = jnp.int32(0)
  for count in (1, 2, 3):  # generations 0 -> 1 -> 2 -> 3
    grads, params = _draw(rng, len(subgroups), size, grad_dtype, master)
    scalars = step_scalars(hyper, count, grad_scale=float(rng.uniform(0.5, 1.0)))
    before = {g: _file_bytes(directory, g, int(gen) % 2) for g in subgroups}
    out, gen = disk.adamw_disk_rows(
        gen, grads, params, scalars, directory=directory, subgroups=subgroups, slots=slots,
        num_slots=k, decayed_rows=decayed_rows, lowp_dtype=lowp, nesterov=nesterov,
        direct_io=direct_io)
    want = memory.step(grads, params, scalars, decayed_rows=decayed_rows, lowp_dtype=lowp,
                       nesterov=nesterov)
    assert int(gen) == count and gen.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), want)
    for g in subgroups:
      np.testing.assert_array_equal(disk.read_state(directory, g, count % 2, k, size),
                                    memory.stacked[g])
      assert _file_bytes(directory, g, (count - 1) % 2) == before[g], 'current half changed'
  assert not [n for n in os.listdir(directory) if n.endswith('.tmp')]


def test_a_hard_link_to_an_old_file_keeps_its_bytes(seed, tmp_path):
  rng, size, subgroups, decayed_rows, slots, _ = _setup(seed, tmp_path, True, rows=3)
  directory = str(tmp_path)
  checkpoint = tmp_path / 'checkpoint'
  checkpoint.mkdir()
  for g in subgroups:
    os.link(disk.state_path(directory, g, 0), checkpoint / f'{g}')
  kept = {g: _file_bytes(directory, g, 0) for g in subgroups}
  gen = 0
  for count in (1, 2):  # the second step writes half 0 again
    grads, _ = _draw(rng, len(subgroups), size, jnp.float32, True)
    _, gen = disk.adamw_disk_rows(
        gen, grads, None, step_scalars(Hyper(), count), directory=directory,
        subgroups=subgroups, slots=slots, num_slots=3, decayed_rows=decayed_rows,
        lowp_dtype=jnp.bfloat16)
  for g in subgroups:
    assert _file_bytes(directory, g, 0) != kept[g]  # half 0 was rewritten...
    assert (checkpoint / f'{g}').read_bytes() == kept[g]  # ...but not the linked file


def test_a_missing_or_short_file_is_an_error_naming_it(seed, tmp_path):
  rng, size, subgroups, decayed_rows, slots, _ = _setup(seed, tmp_path, True, rows=3)
  directory = str(tmp_path)
  kernel = functools.partial(
      disk.adamw_disk_rows, 0, scalars=step_scalars(Hyper(), 1), directory=directory,
      subgroups=subgroups, slots=slots, num_slots=3, decayed_rows=decayed_rows,
      lowp_dtype=jnp.bfloat16)
  grads, _ = _draw(rng, len(subgroups), size, jnp.float32, True)
  kept = {g: _file_bytes(directory, g, 0) for g in subgroups}
  missing = disk.state_path(directory, subgroups[-1], 0)
  os.unlink(missing)
  with pytest.raises(jax.errors.JaxRuntimeError) as failure:
    jax.block_until_ready(kernel(grads, None))
  message = str(failure.value)
  assert f'dos_jax_adamw_disk_rows: cannot open {missing}: No such file or directory' in message
  short = disk.state_path(directory, subgroups[0], 0)
  with open(short, 'r+b') as f:
    f.truncate(4096)
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(f'{short} has 4096 bytes')):
    jax.block_until_ready(kernel(grads, None))
  # The current half is as it was, and no temporary file is left.
  assert _file_bytes(directory, subgroups[1], 0) == kept[subgroups[1]]
  assert not [n for n in os.listdir(directory) if n.endswith('.tmp')]


def test_jitted_steps_do_not_recompile(seed, tmp_path):
  rng, size, subgroups, decayed_rows, slots, memory = _setup(seed, tmp_path, False, rows=3)
  hyper = Hyper()
  options = dict(decayed_rows=decayed_rows, lowp_dtype=jnp.float32)

  @jax.jit
  def step(gen, grads, params, bc1, bc2):
    scalars = kernels.AdamWScalars(
        lr=hyper.lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root,
        weight_decay=hyper.weight_decay, bc1=bc1, bc2=bc2)
    return disk.adamw_disk_rows(gen, grads, params, scalars, directory=str(tmp_path),
                                subgroups=subgroups, slots=slots, num_slots=2, **options)

  gen = jnp.int32(0)
  for count in (1, 2, 3):
    grads, params = _draw(rng, len(subgroups), size, jnp.float32, False)
    scalars = step_scalars(hyper, count)
    out, gen = step(gen, grads, params, scalars.bc1, scalars.bc2)
    np.testing.assert_array_equal(np.asarray(out), memory.step(grads, params, scalars,
                                                                **options))
    np.testing.assert_array_equal(disk.read_state(tmp_path, subgroups[0], count % 2, 2, size),
                                  memory.stacked[subgroups[0]])
  assert int(gen) == 3
  assert step._cache_size() == 1  # pylint: disable=protected-access


def test_bad_arguments_are_named(tmp_path):
  grads = jnp.zeros((2, 8), jnp.float32)
  common = dict(scalars=step_scalars(Hyper(), 1), directory=str(tmp_path), slots=MASTER,
                num_slots=3, decayed_rows=0, lowp_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match='^subgroups must be distinct'):
    disk.adamw_disk_rows(0, grads, None, subgroups=[4, 4], **common)
  with pytest.raises(ValueError, match=r'^grads must be .* D = len\(subgroups\) = 3'):
    disk.adamw_disk_rows(0, grads, None, subgroups=[1, 2, 3], **common)
  with pytest.raises(ValueError, match='^slots='):
    disk.adamw_disk_rows(0, grads, None, subgroups=[1, 2], **{**common, 'num_slots': 2})
  with pytest.raises(ValueError, match='^without a master slot, params'):
    disk.adamw_disk_rows(0, grads, None, subgroups=[1, 2],
                         **{**common, 'slots': NO_MASTER, 'lowp_dtype': jnp.float32})
  with pytest.raises(ValueError, match='^gen must be an integer scalar'):
    disk.adamw_disk_rows(jnp.zeros(2, jnp.int32), grads, None, subgroups=[1, 2], **common)


def test_file_helpers_round_trip(seed, tmp_path):
  rows = np.random.default_rng(seed).standard_normal((3, 1001)).astype(np.float32)
  disk.write_state(tmp_path, 12, 1, rows)
  path = disk.state_path(tmp_path, 12, 1)
  assert path == os.path.join(tmp_path, 'sg000012.1')
  assert os.path.getsize(path) == disk.file_bytes(3, 1001) == 4096 * 3
  np.testing.assert_array_equal(disk.read_state(tmp_path, 12, 1, 3, 1001), rows)
  with pytest.raises(ValueError, match='has 12288 bytes, expected 4096'):
    disk.read_state(tmp_path, 12, 1, 1, 1001)
  with pytest.raises(FileNotFoundError):
    disk.read_state(tmp_path, 12, 0, 3, 1001)


def test_docstring_example_runs():
  result = doctest.testmod(disk, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
