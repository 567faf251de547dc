"""Host regions by columns (`Construction.host_columns`, `columns.split_pieces`): under
the staged lowering (jax 0.12) a host subgroup of the last host call is split into as
many host regions as make one beside each streamed row of the longest lane, the kernel
updating each part's elements of the same donated row in place.

References: the pieces' elements (each exactly once, at the same place); the step with
one region per host subgroup (the `IN_REGION` lowering), bit for bit, which the rest of
the suite compares with optax. Random inputs from the `seed` fixture.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dos_jax
from dos_jax import lowering as lowering_lib
from dos_jax.geometry import columns
from dos_jax.geometry import partition
from dos_jax.geometry.partition import Piece
from dos_jax.geometry.partition import Tier
from dos_jax.kernels import host_adamw_rows
from dos_jax.step import construction
from dos_jax.step import stages
from dos_jax.step.options import StepOptions
from tests.test_adamw import random_grads

pytestmark = pytest.mark.skipif(not host_adamw_rows.rows_kernel_available(),
                                reason='the native host kernel is not built')


def _elements(runs):
  return sorted((r.leaf, r.start + i, r.offset + i) for r in runs for i in range(r.size))


def test_column_parts_hold_each_element_once_at_the_kernels_alignment(seed):
  rng = random.Random(seed)
  for _ in range(300):
    runs, offset = [], 0
    for leaf in range(rng.randint(1, 5)):
      size = rng.randint(1, 2000)
      runs.append(Piece(leaf=leaf, start=rng.randint(0, 40), size=size, offset=offset))
      offset += size + rng.randint(0, 3)
    parts = rng.randint(1, 9)
    split = columns.split_pieces(runs, parts)
    assert 1 <= len(split) <= parts and all(split), (runs, parts, split)
    assert _elements([p for part in split for p in part]) == _elements(runs)
    first = {r.leaf: r.start for r in runs}
    assert all((p.start - first[p.leaf]) % columns.COLUMN_ALIGN == 0
               for part in split for p in part), split
    # In row order, and near-equal: no part over its share by more than the alignment.
    offsets = [p.offset for part in split for p in part]
    assert offsets == sorted(offsets)
    total = sum(r.size for r in runs)
    if len(split) == parts:
      assert max(sum(p.size for p in part) for part in split) <= (
          -(-total // parts) + columns.COLUMN_ALIGN * len(runs)), split


def _params(seed):
  rng = np.random.default_rng(seed)
  return jax.device_put({f'w{i}': jnp.asarray(rng.standard_normal(2048), jnp.float32)
                         for i in range(8)}, jax.devices()[0])


def _opt():
  """8 subgroups, 6 streamed on one lane (a plain jit: XLA's limit of 2) and 2 on the
  host, behind a clip that fires."""
  off = dos_jax.Offload(subgroup_size=2048, policy=dos_jax.DeviceFraction(0.75))
  return dos_jax.chain(dos_jax.clip_by_global_norm(0.5), dos_jax.adamw(
      3e-2, weight_decay=0.05, offload=off,
      implementation=dos_jax.Implementation(program='gpu'))), off


def _run(seed):
  opt, _ = _opt()
  params = _params(seed)
  state = opt.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  for i in range(3):
    params, state = step(params, state,
                         jax.tree.map(lambda g: 3 * g, random_grads(params, i, seed)))
  return params, state


def test_the_staged_step_runs_a_host_region_beside_every_streamed_row(monkeypatch, seed):
  monkeypatch.setattr(lowering_lib, 'of_version', lambda version=None: lowering_lib.Lowering.STAGED)
  opt, off = _opt()
  state = opt.init(_params(seed))[1]
  part = state.partition
  assert len(part.ids(Tier.STREAMED)) == 6 and len(part.ids(Tier.HOST)) == 2
  built = construction.resolve(part, state.layout, None, StepOptions.of(off), native=True)
  last = len(partition.host_calls(range(2), part.early if built.early else ())[-1])
  columns = built.host_columns
  assert built.lanes == 1 and columns * last >= 6 > (columns - 1) * last, built
  assert built.per_block
  assert any(line.startswith(f'host columns: {columns}') for line in built.reasons), built
  lay = stages.layout([[(Tier.STREAMED, list(range(6)))]], num_items=last * columns)
  assert len(lay.grouped) == 6 and lay.after == ((),)
  # The XLA host path has one region: its rows stay after the stages (and it says so).
  xla = StepOptions.of(off, dos_jax.Implementation(host=dos_jax.UpdateImpl.XLA))
  assert construction.resolve(part, state.layout, None, xla, native=True).host_columns == 1


def test_host_columns_give_the_one_region_step_bit_for_bit(monkeypatch, seed):
  """The staged step with its host subgroups in 3 column regions each, against the
  same step laid out in one region per lane (`IN_REGION`): 3 clipped steps, every
  array bit for bit."""
  with monkeypatch.context() as patch:
    patch.setattr(lowering_lib, 'of_version',
                  lambda version=None: lowering_lib.Lowering.IN_REGION)
    reference = _run(seed)
  with monkeypatch.context() as patch:
    patch.setattr(lowering_lib, 'of_version', lambda version=None: lowering_lib.Lowering.STAGED)
    columns = _run(seed)
  for a, b in zip(jax.tree.leaves(columns), jax.tree.leaves(reference), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
