"""Tests of the Pallas AdamW with 8-bit moments (kernels/pallas_adamw8.py): on a GPU
(INTERPRET = False) and in the interpreter on CPU, against the numpy reference's fp32
step (kernels/adamw8_reference.py), and its lowering to one in-place Triton call.

XLA (interpret mode) and Triton may contract a product and a sum into an FMA where the
reference rounds twice: masters agree to 2 fp32 ulps of the update's size plus the
master's own rounding, scales to rtol 1e-6, codes are equal or one apart where m / scale
lies within 16 fp32 steps of a midpoint (m and the scale each an ulp off).
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax.dataflow import lower_for_gpu
from dos_jax.kernels import adamw8_reference as ref
from dos_jax.kernels import pallas_adamw8
from tests.test_adamw8_host import _scalars
from tests.test_adamw8_host import assert_codes_match
from tests.test_adamw8_reference import random_moment

B = ref.BLOCK_SIZE


def _assert_close(got, want, start):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = 4 * 2.0**-24 * (np.abs(want - start) + np.abs(want))
  assert (np.abs(got - want) <= tol).all(), np.abs(got - want).max()


def _check(step, rng, size, grad_dtype, lowp_dtype, nesterov, steps=2):
  master = rng.normal(size=size).astype(np.float32)
  mu = ref.quantize(random_moment(rng, (size,), True), ref.code_map(True))
  nu = ref.quantize(random_moment(rng, (size,), False), ref.code_map(False))
  k = (jnp.asarray(master), ref.Quantized(*map(jnp.asarray, mu)),
       ref.Quantized(*map(jnp.asarray, nu)))
  limit = size // 3 + 5  # inside a block
  for count in range(1, steps + 1):
    grad = jnp.asarray(random_moment(rng, (size,), True), grad_dtype)
    scalars, kw = _scalars(count, 0.5, nesterov)
    p, m, v, low = step(*k, grad, scalars, decay_limit=limit, lowp_dtype=lowp_dtype,
                        nesterov=nesterov)
    want = ref.adamw8_step(master, mu, nu, np.asarray(grad.astype(jnp.float32)), **kw,
                           decay_limit=limit, dtype=np.float32, with_moments=True)
    _assert_close(p, want[0], master)
    for got, q, exact, signed in ((m, want[1], want[3], True), (v, want[2], want[4], False)):
      np.testing.assert_allclose(np.asarray(got.scales), q.scales, rtol=1e-6, atol=0)
      assert_codes_match(got, q, exact, signed, ulps=16)
    if lowp_dtype is None:
      assert low is None
    else:
      np.testing.assert_array_equal(np.asarray(low), np.asarray(p.astype(lowp_dtype)))
    master, mu, nu = np.asarray(p), ref.Quantized(*map(np.asarray, m)), \
        ref.Quantized(*map(np.asarray, v))
    k = (p, m, v)


class Pallas8Tests:
  """The tests; collected through the two subclasses below."""

  INTERPRET = False
  CONFIG = pallas_adamw8.DEFAULT_CONFIG8

  def _step(self, *args, **kw):
    return pallas_adamw8.adamw8_pallas(*args, **kw, config=self.CONFIG,
                                       interpret=self.INTERPRET)

  @pytest.mark.parametrize('grad_dtype, lowp_dtype, nesterov', [
      (jnp.bfloat16, jnp.bfloat16, False),
      (jnp.float32, None, True),
  ])
  def test_matches_the_float32_reference(self, grad_dtype, lowp_dtype, nesterov, seed):
    rng = np.random.default_rng(seed)
    # 12 blocks: three programs of 4 (interpret's config); 3 blocks: programs of 1.
    for blocks in (12, 3):
      _check(self._step, rng, blocks * B, grad_dtype, lowp_dtype, nesterov)


@pytest.mark.gpu
class TestPallasAdamW8Gpu(Pallas8Tests):
  INTERPRET = False


class TestPallasAdamW8Interpret(Pallas8Tests):
  INTERPRET = True
  CONFIG = pallas_adamw8.Block8Config(blocks_per_program=4)


def test_jnp_form_matches_the_reference_on_ragged_rows(seed):
  _check(pallas_adamw8.adamw8_jnp, np.random.default_rng(seed), 5 * B + 77, jnp.bfloat16,
         jnp.float16, False)


def test_lowers_to_one_in_place_triton_call():
  size = 64 * B
  scalars, _ = _scalars(3, 1.0, False)

  def step(master, mc, ms, vc, vs, grad):
    return pallas_adamw8.adamw8_pallas(master, ref.Quantized(mc, ms), ref.Quantized(vc, vs),
                                       grad, scalars, decay_limit=size // 2,
                                       lowp_dtype=jnp.bfloat16)
  s = jax.ShapeDtypeStruct
  text = lower_for_gpu(step, s((size,), jnp.float32), s((size,), jnp.uint8),
                       s((size // B,), jnp.float32), s((size,), jnp.uint8),
                       s((size // B,), jnp.float32), s((size,), jnp.bfloat16)).as_text()
  assert text.count('__gpu$xla.gpu.triton') == 1
  assert f'grid_x = {64 // pallas_adamw8.DEFAULT_CONFIG8.blocks_per_program}' in text
  for output, operand in ((0, 4), (1, 5), (2, 6), (3, 7), (4, 8)):
    assert f'output_tuple_indices = [{output}], operand_index = {operand},' in text


def test_docstring_example_runs():
  result = doctest.testmod(pallas_adamw8, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0, result
