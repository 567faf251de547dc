"""Tests of the Pallas AdamW: on a GPU (INTERPRET = False) and in the interpreter on CPU.

The library's kernel is the block form, `adamw_pallas_rows`; the flat form
(experiments/pallas_adamw_flat.py, a benchmark's) shares its math, is checked against
optax here, and is what the block form is checked against.

As in jax's tests/pallas/gpu_ops_test.py, one test class runs the compiled kernel and
skips without a GPU, and one with INTERPRET = True runs the same tests anywhere (both
subclass a mixin, so that the `gpu` mark of the first is not inherited by the second).
Interpret mode is slow, so sizes stay small and blocks are shrunk to get several
programs and a ragged last block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dos_jax import kernels
from dos_jax.dataflow import lower_for_gpu
from dos_jax.kernels import host_adamw_rows
from experiments.pallas_adamw_flat import adamw_pallas
from tests.test_kernels_scalars import assert_close_to_optax
from tests.test_kernels_scalars import check_across_decay_boundary
from tests.test_kernels_scalars import Hyper
from tests.test_kernels_scalars import optax_trajectory
from tests.test_kernels_scalars import random_grad
from tests.test_kernels_scalars import random_state
from tests.test_kernels_scalars import step_scalars


class PallasAdamWTests:
  """The tests; collected through the two subclasses below."""

  INTERPRET = False
  CONFIG = kernels.DEFAULT_CONFIG  # on a GPU: the real blocks
  SIZES = (1, 7, 3000, 1_000_003)

  def _pallas(self, hyper, count, state, grad, *, decay_limit, lowp_dtype=jnp.bfloat16,
              grad_scale=1.0):
    return adamw_pallas(*state, grad, step_scalars(hyper, count, grad_scale),
                        decay_limit=decay_limit, lowp_dtype=lowp_dtype,
                        nesterov=hyper.nesterov, config=self.CONFIG,
                        interpret=self.INTERPRET)

  @pytest.mark.parametrize('decay', [True, False])
  def test_fp32_matches_optax(self, decay):
    hyper = Hyper()
    for size in self.SIZES:
      rng = np.random.default_rng(size)
      master = random_state(rng, size)[0]
      grads = [random_grad(rng, size) for _ in range(3)]
      limit = size if decay else 0
      expected = optax_trajectory(hyper, master, grads, limit)
      state = (master, jnp.zeros(size), jnp.zeros(size))
      for count, (grad, want) in enumerate(zip(grads, expected), start=1):
        *state, lowp = self._pallas(hyper, count, state, grad, decay_limit=limit)
        assert_close_to_optax(state, want, hyper.lr)
        np.testing.assert_array_equal(np.asarray(lowp),
                                      np.asarray(state[0].astype(jnp.bfloat16)))

  @pytest.mark.parametrize('hyper', [Hyper(eps_root=1e-12, lr=3e-2), Hyper(nesterov=True)],
                           ids=['eps_root', 'nesterov'])
  def test_matches_optax_across_a_decay_boundary(self, hyper, seed):
    size = self.SIZES[2]
    limit = size // 3 + 5  # inside a block, not on a block edge
    check_across_decay_boundary(self._pallas, hyper, size=size, limit=limit, seed=seed, steps=2)

  @pytest.mark.parametrize('grad_dtype, mu_dtype, lowp_dtype', [
      (jnp.bfloat16, jnp.float32, jnp.float16),
      (jnp.float32, jnp.bfloat16, jnp.float32),
      (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
  ])
  def test_matches_reference_and_host_kernel(self, grad_dtype, mu_dtype, lowp_dtype, seed):
    hyper = Hyper(eps_root=1e-10)
    size = self.SIZES[2]
    rng = np.random.default_rng(seed)
    state = random_state(rng, size, mu_dtype)
    grad = random_grad(rng, size, grad_dtype)
    kw = dict(decay_limit=size // 2, lowp_dtype=lowp_dtype, grad_scale=np.float32(0.5))
    got = self._pallas(hyper, 4, state, grad, **kw)
    scalars = step_scalars(hyper, 4, np.float32(0.5))
    want = jax.jit(lambda *a: kernels.adamw_reference(
        *a, scalars, decay_limit=kw['decay_limit'], lowp_dtype=lowp_dtype))(*state, grad)
    for g, w in zip(got, want):
      assert g.dtype == w.dtype and g.shape == w.shape
    assert_close_to_optax(got[:3], want[:3], hyper.lr)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(got[0].astype(lowp_dtype)))
    if mu_dtype == jnp.float32 and host_adamw_rows.rows_kernel_available():
      # The native host kernel on the same subgroup (one row of a (1, 3, S) state),
      # every element decayed or none (it decays whole subgroups): the decayed half.
      limit = kw['decay_limit']
      stacked = jnp.stack(jax.device_get(state))[None, :, :limit]
      host, _ = kernels.adamw_host_rows(
          stacked, jax.device_get(grad)[None, :limit], None, jnp.zeros(1, jnp.int32),
          scalars, slots=(0, 1, 2), decayed_rows=1, lowp_dtype=lowp_dtype)
      assert_close_to_optax([x[:limit] for x in jax.device_get(got[:3])], list(host[0]),
                            hyper.lr)

  def test_donated_call_is_in_place_and_compiles_once(self, seed):
    size, hyper = self.SIZES[2], Hyper()
    rng = np.random.default_rng(seed)

    def step(state, grad, scalars):
      master, mu, nu, lowp = state
      return adamw_pallas(master, mu, nu, grad, scalars, decay_limit=size,
                          lowp_dtype=jnp.bfloat16, config=self.CONFIG,
                          interpret=self.INTERPRET, lowp_out=lowp)
    step = jax.jit(step, donate_argnums=0)
    state = jax.jit(lambda x: tuple(a + 0 for a in x))(
        (*random_state(rng, size), jnp.zeros(size, jnp.bfloat16)))
    jaxpr = jax.make_jaxpr(step)(state, random_grad(rng, size), step_scalars(hyper, 1))
    assert 'input_output_aliases=((2, 0), (3, 1), (4, 2), (6, 3))' in str(jaxpr)
    pointers = [x.unsafe_buffer_pointer() for x in state]
    for count in range(1, 4):
      grad, scalars = random_grad(rng, size), step_scalars(hyper, count)
      want = jax.jit(lambda s, *a: kernels.adamw_reference(
          *a, s, decay_limit=size, lowp_dtype=jnp.bfloat16))(scalars, *state[:3], grad)
      state = step(tuple(state), grad, scalars)
      assert_close_to_optax(state[:3], want[:3], hyper.lr)
      if not self.INTERPRET:  # the interpreter pads blocks, so only a GPU reuses buffers
        assert [x.unsafe_buffer_pointer() for x in state] == pointers
    assert step._cache_size() == 1

  def test_no_low_precision_copy_when_lowp_dtype_is_none(self, seed):
    size, hyper = self.SIZES[2], Hyper()
    rng = np.random.default_rng(seed)
    state, grad = random_state(rng, size), random_grad(rng, size)
    got = self._pallas(hyper, 2, state, grad, decay_limit=size, lowp_dtype=None)
    assert got[3] is None
    want = self._pallas(hyper, 2, state, grad, decay_limit=size)
    for g, w in zip(got[:3], want[:3]):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

  def test_vmap_over_stacked_subgroups_uses_per_subgroup_scalars(self, seed):
    size, hyper = self.SIZES[2], Hyper()
    rng = np.random.default_rng(seed)
    rows = [random_state(rng, size) for _ in range(2)]
    grads = jnp.stack([random_grad(rng, size) for _ in range(2)])
    scalars = jax.tree.map(lambda *x: jnp.stack([jnp.asarray(v, jnp.float32) for v in x]),
                           step_scalars(hyper, 1), step_scalars(hyper, 4))
    limits = jnp.asarray([0, size // 2], jnp.int32)

    def one(master, mu, nu, grad, scalars, limit):
      return adamw_pallas(master, mu, nu, grad, scalars, decay_limit=limit,
                          lowp_dtype=jnp.bfloat16, config=self.CONFIG,
                          interpret=self.INTERPRET)
    stacked = [jnp.stack(x) for x in zip(*rows)]
    got = jax.jit(jax.vmap(one))(*stacked, grads, scalars, limits)
    for i in range(2):
      want = one(*rows[i], grads[i], jax.tree.map(lambda x: x[i], scalars), limits[i])
      for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))

  @pytest.mark.parametrize('slots', [(0, 1, 2), (2, 0, 1), (-1, 0, 1)],
                           ids=['master_mu_nu', 'mu_nu_master', 'no_master'])
  def test_rows_form_equals_the_flat_kernel_in_place(self, slots, seed):
    """`adamw_pallas_rows` on a (K, S) block gives the flat kernel's values (within the
    ulp two programs of the same math may differ by), in the block's own buffer
    (aliased), for any slot order and without a master row."""
    size, hyper = self.SIZES[2], Hyper(eps_root=1e-10)
    rng = np.random.default_rng(seed)
    master, mu, nu = random_state(rng, size)
    param = master if slots[0] < 0 else None
    rows = {slots[1]: mu, slots[2]: nu, **({} if param is not None else {slots[0]: master})}
    block = jnp.stack([rows[k] for k in range(len(rows))])
    grad, scalars = random_grad(rng, size, jnp.bfloat16), step_scalars(hyper, 3, 0.5)
    lowp_dtype = None if param is not None else jnp.bfloat16
    want = adamw_pallas(master, mu, nu, grad, scalars, decay_limit=size // 3,
                        lowp_dtype=lowp_dtype, config=self.CONFIG,
                        interpret=self.INTERPRET)

    def rows_step(block, grad, param):
      return kernels.adamw_pallas_rows(block, grad, scalars, slots=slots,
                                       decay_limit=size // 3, lowp_dtype=lowp_dtype,
                                       param=param, config=self.CONFIG,
                                       interpret=self.INTERPRET)
    jaxpr = str(jax.make_jaxpr(rows_step)(block, grad, param))
    assert 'input_output_aliases=((2, 0),)' in jaxpr
    new_block, new_master, lowp = jax.jit(rows_step)(block, grad, param)
    got_master = new_master if param is not None else new_block[slots[0]]
    # Two programs of the same math: an ulp apart where XLA contracts differently.
    assert_close_to_optax((got_master, new_block[slots[1]], new_block[slots[2]]), want[:3],
                          hyper.lr)
    if lowp_dtype is not None:
      np.testing.assert_array_equal(np.asarray(lowp), np.asarray(got_master.astype(lowp_dtype)))
    else:
      assert lowp is None

  def test_rows_form_refuses_a_block_that_breaks_its_contract(self, seed):
    size, hyper = 64, Hyper()
    rng = np.random.default_rng(seed)
    block = jnp.stack(random_state(rng, size))
    call = functools.partial(kernels.adamw_pallas_rows, grad=random_grad(rng, size),
                             scalars=step_scalars(hyper, 1), decay_limit=size,
                             lowp_dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match='param must be given exactly'):
      call(block, slots=(-1, 0, 1))
    with pytest.raises(ValueError, match='not distinct rows'):
      call(block, slots=(0, 1, 1))
    with pytest.raises(ValueError, match=r'float32 \(K, S\) block'):
      call(block.astype(jnp.bfloat16), slots=(0, 1, 2))

  def test_bad_block_config_is_a_clear_error(self):
    with pytest.raises(ValueError, match='block_size'):
      kernels.BlockConfig(block_size=1000)


@pytest.mark.gpu
class TestPallasAdamWGpu(PallasAdamWTests):
  INTERPRET = False


class TestPallasAdamWInterpret(PallasAdamWTests):
  INTERPRET = True
  CONFIG = kernels.BlockConfig(block_size=256, num_warps=1)
  SIZES = (1, 7, 1000)


@pytest.mark.parametrize('size, grad_dtype, mu_dtype, lowp_dtype, nesterov', [
    (1_000_003, jnp.float32, jnp.float32, jnp.bfloat16, False),
    (1_000_003, jnp.bfloat16, jnp.bfloat16, jnp.float16, True),
    (7, jnp.float32, jnp.float32, jnp.float32, False),  # one block, larger than the array
])
def test_lowers_to_triton_for_a_gpu_from_any_machine(size, grad_dtype, mu_dtype,
                                                     lowp_dtype, nesterov):
  # Lowering for CUDA needs no GPU: it checks the Triton path (masked tails, IEEE
  # div/sqrt by inline PTX, aliases) where CI has none.
  scalars = step_scalars(Hyper(nesterov=nesterov), 3)

  def step(master, mu, nu, grad, lowp):
    return adamw_pallas(master, mu, nu, grad, scalars, decay_limit=size // 2,
                        lowp_dtype=lowp_dtype, nesterov=nesterov, lowp_out=lowp)
  args = [jax.ShapeDtypeStruct((size,), d)
          for d in (jnp.float32, mu_dtype, jnp.float32, grad_dtype, lowp_dtype)]
  text = lower_for_gpu(step, *args).as_text()  # an abstract GPU device where jax needs one
  assert '__gpu$xla.gpu.triton' in text
  grid = -(-size // kernels.DEFAULT_CONFIG.block_size)
  assert f'grid_x = {grid}' in text
  for output, operand in ((0, 2), (1, 3), (2, 4), (3, 6)):
    assert (f'output_tuple_indices = [{output}], operand_index = {operand},') in text


@pytest.mark.parametrize('rows, slots, grad_dtype', [
    (3, (0, 1, 2), jnp.bfloat16),
    (2, (-1, 0, 1), jnp.float32),
])
def test_rows_form_lowers_to_one_in_place_triton_call(rows, slots, grad_dtype):
  """The block form lowers to Triton with its (K, S) block aliased, K not a power of
  two included (only the loaded rows must be)."""
  size = 1_000_003
  scalars = step_scalars(Hyper(), 3)

  def step(block, grad, param):
    return kernels.adamw_pallas_rows(block, grad, scalars, slots=slots, decay_limit=size // 2,
                                     lowp_dtype=None if slots[0] < 0 else jnp.bfloat16,
                                     param=param)
  param = jax.ShapeDtypeStruct((size,), jnp.float32) if slots[0] < 0 else None
  text = lower_for_gpu(step, jax.ShapeDtypeStruct((rows, size), jnp.float32),
                       jax.ShapeDtypeStruct((size,), grad_dtype), param).as_text()
  assert text.count('__gpu$xla.gpu.triton') == 1
  assert 'output_tuple_indices = [0], operand_index = 2,' in text
