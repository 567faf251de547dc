"""The Pallas AdamW with block-wise 8-bit moments (Triton backend), in place, in one pass.

The device side of `adamw8_reference`'s format: one program takes `blocks_per_program`
quantization blocks of 256 elements of a row, decodes mu and nu (map[code] * scale, a
load from the 256-entry map), takes the AdamW step in fp32, writes the new master and
its 16-bit copy, and re-encodes the moments with each block's new absolute maximum
(the host kernel's bucket table: one load and one integer compare per code,
host_adamw8.quant_tables). The new moments stay in registers.

Bytes per element: 16.06 with bf16 gradients and a bf16 copy (master 4 + 4, codes 1 + 1
per moment, scales 2 * 8 / 256, gradient 2, copy 2), against 28 for the fp32-state
kernel (pallas_adamw.py); the two tables (2 KB and 96 KB) stay in cache.

Same math as `adamw8_reference.adamw8_step(..., dtype=np.float32)` except that XLA (in
interpret mode) and Triton may contract a product and a sum into an FMA: masters and
scales agree to an fp32 ulp, codes equal or one apart next to a midpoint
(tests/test_adamw8_pallas.py). `adamw8_jnp` is the same step in plain jnp.

Example (interpret mode, any backend):
  >>> import jax.numpy as jnp
  >>> from dos_jax.kernels import adamw8_reference as ref, pallas_adamw8
  >>> from dos_jax.kernels.adamw_scalars import AdamWScalars
  >>> mu, nu = ref.zeros((512,))
  >>> s = AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
  ...                  weight_decay=0.0, bc1=0.1, bc2=0.001)
  >>> master, mu, nu, low = pallas_adamw8.adamw8_pallas(
  ...     jnp.ones(512), ref.Quantized(*map(jnp.asarray, mu)),
  ...     ref.Quantized(*map(jnp.asarray, nu)), jnp.ones(512), s, decay_limit=0,
  ...     lowp_dtype=jnp.bfloat16, interpret=True)
  >>> float(master[0]), mu.codes.dtype.name, float(mu.scales[0])
  (0.9990000128746033, 'uint8', 0.10000000149011612)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from dos_jax.kernels import adamw8_reference as ref
from dos_jax.kernels import adamw_scalars
from dos_jax.kernels import host_adamw8
from dos_jax.kernels.adamw_scalars import AdamWScalars

_F32 = jnp.float32
_B = ref.BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class Block8Config:
  """How a row's quantization blocks are cut into Triton programs."""

  blocks_per_program: int = 8  # 256-element blocks per program (2048 elements); a power of two
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for name in ('blocks_per_program', 'num_warps'):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f'Block8Config.{name} must be a power of two, got {value}')


DEFAULT_CONFIG8 = Block8Config()


def _encode(x, table):
  """Codes (int32) of fp32 x in one map's encoding table (host_adamw8._encoding_table,
  flattened [sign * stride + bucket])."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  neg = bits < 0
  a = bits & 0x7fffffff
  k = jnp.clip((a >> 15) - host_adamw8._BUCKET_BASE, 0, host_adamw8._BUCKETS - 1)  # pylint: disable=protected-access
  k = jnp.where(neg, k + host_adamw8._BUCKET_STRIDE, k)  # pylint: disable=protected-access
  entry = table(k)
  base, low = entry & 0xff, (entry >> 8) - 1
  return base + jnp.where((a & 0x7fff) > low, jnp.where(neg, -1, 1), 0)


def _step_math(c, master, m0, v0, grad, decayed, *, nesterov):
  """The fp32 step from decoded moments (adamw8_reference.adamw8_step's order)."""
  g = grad.astype(_F32) * c.grad_scale
  m = c.one_minus_b1 * g + c.b1 * m0
  v = c.one_minus_b2 * (g * g) + c.b2 * v0
  if nesterov:
    m_hat = c.b1 * (m * c.inv_bc1_next) + c.one_minus_b1 * (g * c.inv_bc1)
  else:
    m_hat = m * c.inv_bc1
  u = m_hat / (jnp.sqrt(v * c.inv_bc2 + c.eps_root) + c.eps)
  u = jnp.where(decayed, u + c.weight_decay * master, u)
  return master + c.neg_lr * u, m, v


def _scale_and_inverse(x):
  """Per block (rows of x): max |x| and its reciprocal (0 for a block of zeros)."""
  scale = jnp.max(jnp.abs(x), axis=1)
  inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
  return scale, inv


def _adamw8_kernel(coeffs_ref, limit_ref, maps_ref, enc_ref, master_ref, mc_ref, ms_ref,
                   vc_ref, vs_ref, grad_ref, master_out, mc_out, ms_out, vc_out, vs_out,
                   *lowp_out, blocks: int, nesterov: bool):
  coeffs = adamw_scalars.Coefficients(
      *(coeffs_ref[i] for i in range(len(adamw_scalars.Coefficients._fields))))
  row0 = pl.program_id(0) * blocks
  col = jnp.arange(_B, dtype=jnp.int32)[None, :]
  idx = (row0 + jnp.arange(blocks, dtype=jnp.int32))[:, None] * _B + col
  mc = mc_ref[...].astype(jnp.int32)
  vc = vc_ref[...].astype(jnp.int32)
  m0 = maps_ref[mc] * ms_ref[...][:, None]
  v0 = maps_ref[vc + _B] * vs_ref[...][:, None]
  master, m, v = _step_math(coeffs, master_ref[...], m0, v0, grad_ref[...],
                            idx < limit_ref[0], nesterov=nesterov)
  master_out[...] = master
  if lowp_out:
    lowp_out[0][...] = master.astype(lowp_out[0].dtype)
  stride = 2 * host_adamw8._BUCKET_STRIDE  # pylint: disable=protected-access
  for x, codes_out, scales_out, offset in ((m, mc_out, ms_out, 0), (v, vc_out, vs_out, stride)):
    scale, inv = _scale_and_inverse(x)
    scales_out[...] = scale
    codes = _encode(x * inv[:, None], lambda k, o=offset: enc_ref[k + o])
    codes_out[...] = codes.astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=('lowp_dtype', 'nesterov', 'config', 'interpret'))
def _adamw8_call(packed, limit, maps, enc, master, mc, ms, vc, vs, grad, *, lowp_dtype,
                 nesterov, config, interpret):
  nb = master.shape[0]
  t = math.gcd(nb, config.blocks_per_program)  # whole programs only: no ragged last one
  tile = pl.BlockSpec((t, _B), lambda i: (i, 0))
  scales = pl.BlockSpec((t,), lambda i: (i,))
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (master, mc, ms, vc, vs)]
  if lowp_dtype is not None:
    out_shape.append(jax.ShapeDtypeStruct(master.shape, lowp_dtype))
  return pl.pallas_call(
      functools.partial(_adamw8_kernel, blocks=t, nesterov=nesterov),
      grid=(pl.cdiv(nb, t),),
      in_specs=[whole(adamw_scalars.NUM_SLOTS), whole(1), whole(maps.shape[0]),
                whole(enc.shape[0]), tile, tile, scales, tile, scales, tile],
      out_specs=[tile, tile, scales, tile, scales] + [tile] * (lowp_dtype is not None),
      out_shape=out_shape,
      input_output_aliases={4: 0, 5: 1, 6: 2, 7: 3, 8: 4},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name='dos_jax_adamw8',
  )(packed, limit, maps, enc, master, mc, ms, vc, vs, grad)


def adamw8_pallas(master, mu: ref.Quantized, nu: ref.Quantized, grad, scalars: AdamWScalars,
                  *, decay_limit, lowp_dtype: Any = None, nesterov: bool = False,
                  config: Block8Config = DEFAULT_CONFIG8, interpret: bool = False):
  """One AdamW step with 8-bit moments on one row, in place, in one Pallas kernel.

  Args:
    master: f32[S], S a multiple of 256 (aliased to the first result).
    mu, nu: `Quantized(codes uint8[S], scales f32[S // 256])` (aliased).
    grad: f32[S] or bf16[S]; multiplied by `scalars.grad_scale` first.
    scalars: the step's `AdamWScalars`.
    decay_limit: int32 scalar (may be traced); weight decay applies below it.
    lowp_dtype: dtype of the new master's copy written in the same pass, or None.
    nesterov: optax's Nesterov variant (needs `scalars.bc1_next`).
    config: programs' sizes.
    interpret: run in the Pallas interpreter (any backend, CPU included).

  Returns:
    `(master, mu, nu, copy or None)`.
  """
  size = master.shape[0] if master.ndim == 1 else -1
  if master.ndim != 1 or master.dtype != _F32 or size % _B:
    raise ValueError(f'master must be f32[S] with S a multiple of {_B}, got '
                     f'{master.dtype}{list(master.shape)}')
  nb = size // _B
  for name, q in (('mu', mu), ('nu', nu)):
    if q.codes.shape != (size,) or q.codes.dtype != jnp.uint8 or q.scales.shape != (nb,) \
        or q.scales.dtype != _F32:
      raise ValueError(f'{name} must be uint8[{size}] codes and f32[{nb}] scales, got '
                       f'{q.codes.dtype}{list(q.codes.shape)}, {q.scales.dtype}'
                       f'{list(q.scales.shape)}')
  if grad.shape != (size,) or grad.dtype not in (jnp.dtype(_F32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f'grad must be f32 or bf16 [{size}], got {grad.dtype}{list(grad.shape)}')
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  maps, enc = host_adamw8.quant_tables()
  tile = lambda x: x.reshape(nb, _B)
  out = _adamw8_call(
      packed, jnp.reshape(jnp.asarray(decay_limit, jnp.int32), (1,)),
      jnp.asarray(maps.reshape(-1)), jnp.asarray(enc.reshape(-1).view('int32')),
      tile(master), tile(mu.codes), mu.scales, tile(nu.codes), nu.scales, tile(grad),
      lowp_dtype=None if lowp_dtype is None else jnp.dtype(lowp_dtype), nesterov=nesterov,
      config=config, interpret=interpret)
  flat = lambda x: x.reshape(size)
  return (flat(out[0]), ref.Quantized(flat(out[1]), out[2]),
          ref.Quantized(flat(out[3]), out[4]), flat(out[5]) if lowp_dtype is not None else None)


def adamw8_jnp(master, mu: ref.Quantized, nu: ref.Quantized, grad, scalars: AdamWScalars, *,
               decay_limit, lowp_dtype: Any = None, nesterov: bool = False):
  """`adamw8_pallas`'s step in plain jnp (any S): the reference beside the kernel."""
  size = master.shape[0]
  nb = ref.num_blocks(size)
  pad = nb * _B - size
  c = adamw_scalars.coefficients(scalars, nesterov=nesterov)
  maps, enc = (jnp.asarray(t) for t in host_adamw8.quant_tables())
  enc = enc.reshape(-1).view(jnp.int32)
  tiles = lambda x: jnp.pad(x, (0, pad)).reshape(nb, _B)
  m0 = maps[0][tiles(mu.codes).astype(jnp.int32)] * mu.scales[:, None]
  v0 = maps[1][tiles(nu.codes).astype(jnp.int32)] * nu.scales[:, None]
  idx = jnp.arange(nb * _B, dtype=jnp.int32).reshape(nb, _B)
  new_master, m, v = _step_math(c, tiles(master), m0, v0, tiles(grad), idx < decay_limit,
                                nesterov=nesterov)
  live = idx < size  # padding is zero in m and v; it must not count in a block's max
  result = []
  for x, offset in ((m, 0), (v, 2 * host_adamw8._BUCKET_STRIDE)):  # pylint: disable=protected-access
    x = jnp.where(live, x, 0)
    scale, inv = _scale_and_inverse(x)
    codes = _encode(x * inv[:, None], lambda k, o=offset: enc[k + o])
    result.append(ref.Quantized(codes.astype(jnp.uint8).reshape(-1)[:size], scale))
  new_master = new_master.reshape(-1)[:size]
  return (new_master, result[0], result[1],
          None if lowp_dtype is None else new_master.astype(lowp_dtype))
