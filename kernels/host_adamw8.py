"""Native host AdamW with block-wise 8-bit moments, in place, in one call (host_adamw8.cc).

The moments are in `adamw8_reference`'s format: uint8 codes into the signed (mu) and
unsigned (nu) dynamic maps, one fp32 scale per block of 256 elements of a row. The
master is fp32. Per element the host state is 4 + 1 + 1 B, plus 8 B of scales per 256
elements: about 6.03 B instead of the fp32 state's 12. The kernel's arithmetic is
`adamw8_reference.adamw8_step(..., dtype=np.float32)`'s: masters and scales equal it bit
for bit, codes up to one apart where m / scale is within a few fp32 steps of a midpoint
(tests/test_adamw8_host.py).

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from dos_jax.kernels import adamw8_reference as ref, host_adamw8
  >>> from dos_jax.kernels.adamw_scalars import AdamWScalars
  >>> mu, nu = ref.zeros((2, 300))
  >>> s = AdamWScalars(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
  ...                  weight_decay=0.1, bc1=0.1, bc2=0.001)
  >>> master, mu, nu, out = host_adamw8.adamw8_host(
  ...     jnp.ones((2, 300)), mu, nu, jnp.ones((2, 300)), s, decayed_rows=2,
  ...     lowp_dtype=jnp.bfloat16)
  >>> float(master[0, 0]), mu.scales.shape, out.dtype.name
  (0.9988999962806702, (2, 2), 'bfloat16')
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.kernels import _native
from dos_jax.kernels import adamw8_reference as ref
from dos_jax.kernels import adamw_scalars
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import check_threads_and_isa
from dos_jax.kernels.host_adamw import HostIsa

_TARGET = 'dos_jax_adamw8_host'
_BUCKETS = 6145  # buckets of |x| in [2^-24, 1], 8 mantissa bits each (host_adamw8.cc)
_BUCKET_STRIDE = 6160
_BUCKET_BASE = 103 << 8  # fp32 bits >> 15 of 2^-24
_GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LOWP_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.cache
def _load() -> tuple[Any, str]:
  return _native.load('_host_adamw8', {_TARGET: 'handler'}, 'native 8-bit-moment host AdamW')


def adamw8_kernel_available() -> bool:
  """Whether the 8-bit-moment native host AdamW is built, loadable and registered."""
  return _load()[0] is not None


def adamw8_kernel_unavailable_reason() -> str:
  """Why `adamw8_kernel_available()` is False ('' when it is True)."""
  return _load()[1]


def _encoding_table(table: np.ndarray) -> np.ndarray:
  """The encoding table of one map: uint32 (2, stride), [x >= 0, x < 0] by bucket of |x|.

  Entry = base | (low + 1) << 8: base is the code of the bucket's lower edge A (the
  bucket of x >= 0 is [A, next A), of x < 0 (-next A, -A]), low the one threshold in the
  bucket as fp32 bits above A's; the code of x is base + step when (|x|'s bits - A's) >
  low, step +1 for x >= 0 and -1 below, so for every fp32 x it is `ref.nearest_code(x)`
  (tested). No threshold in a bucket: low = 0x7fff, never exceeded.
  """
  mids = (table[:-1].astype(np.float64) + table[1:]) / 2
  k = np.arange(_BUCKETS + 1, dtype=np.int64)
  edge_bits = ((k + _BUCKET_BASE) << 15).astype(np.uint32)
  edges = edge_bits.view(np.float32).astype(np.float64)
  lower, upper = edges[:-1].copy(), edges[1:].copy()
  lower[0], upper[-1] = 0.0, np.inf  # the first and last buckets take all below and above
  lower_bits = edge_bits[:-1].astype(np.int64)
  never = np.int64(0x7fff)
  f32 = lambda v: np.asarray(v, np.float64).astype(np.float32)
  bits = lambda v: f32(v).view(np.int32).astype(np.int64)
  out = np.zeros((2, _BUCKET_STRIDE), np.uint32)
  # x >= 0: the first midpoint at or above the lower edge, if below the upper one;
  # |x| > mid  <=>  |x| > (the largest fp32 <= mid).
  up = np.searchsorted(mids, lower, side='left')
  assert (np.searchsorted(mids, upper, side='left') - up <= 1).all(), 'two midpoints in a bucket'
  mid = mids[np.minimum(up, 254)]
  floor = np.where(f32(mid) > mid, np.nextafter(f32(mid), np.float32(-np.inf)), f32(mid))
  inside = (up < 255) & (mid < upper)
  low = np.where(inside, bits(floor) - lower_bits, never)
  out[0, :_BUCKETS] = up | (low + 1) << 8
  # x < 0: the last midpoint below -lower, if above -upper; |x| >= -mid  <=>  |x| >
  # (the fp32 below the smallest fp32 >= -mid).
  down = np.searchsorted(mids, -lower, side='left')
  assert (down - np.searchsorted(mids, -upper, side='left') <= 1).all()
  mid = -mids[np.maximum(down - 1, 0)]
  ceil = np.where(f32(mid) < mid, np.nextafter(f32(mid), np.float32(np.inf)), f32(mid))
  inside = (down > 0) & (mid < upper)
  low = np.where(inside, bits(ceil) - 1 - lower_bits, never)
  out[1, :_BUCKETS] = down | (low + 1) << 8
  assert ((out[:, :_BUCKETS] >> 8) <= 0x8000).all()
  return out


@functools.cache
def quant_tables() -> tuple[np.ndarray, np.ndarray]:
  """The kernel's tables: maps f32 (2, 256) [signed, unsigned] and the encoding tables
  uint32 (2, 2, stride) [map, sign] (`_encoding_table`)."""
  maps = np.stack([ref.code_map(True), ref.code_map(False)])
  return maps, np.stack([_encoding_table(m) for m in maps])


def encode(x: np.ndarray, signed: bool) -> np.ndarray:
  """The host kernel's encoding of fp32 x (already divided by its scale), in numpy: for
  tests of the tables against `ref.nearest_code`."""
  _, tables = quant_tables()
  entries = tables[0 if signed else 1]
  bits = np.asarray(x, np.float32).view(np.uint32)
  neg = (bits >> 31).astype(np.int64)
  a = (bits & 0x7fffffff).astype(np.int64)
  k = np.clip((a >> 15) - _BUCKET_BASE, 0, _BUCKETS - 1)
  entry = entries[neg, k].astype(np.int64)
  base, low = entry & 0xff, (entry >> 8) - 1
  step = np.where((a & 0x7fff) > low, np.where(neg == 1, -1, 1), 0)
  # The clamped buckets hold no threshold, so a's low bits never matter there.
  return (base + step).astype(np.uint8)


def _check(master, mu, nu, grad, lowp_dtype) -> None:
  if master.ndim != 2 or master.dtype != jnp.float32:
    raise ValueError(f'master must be f32 (R, S), got {master.dtype}{list(master.shape)}')
  rows, size = master.shape
  scales = (rows, ref.num_blocks(size))
  for name, q in (('mu', mu), ('nu', nu)):
    if q.codes.shape != master.shape or q.codes.dtype != jnp.uint8:
      raise ValueError(f'{name}.codes must be uint8 {list(master.shape)}, got '
                       f'{q.codes.dtype}{list(q.codes.shape)}')
    if q.scales.shape != scales or q.scales.dtype != jnp.float32:
      raise ValueError(f'{name}.scales must be f32 {list(scales)}, got '
                       f'{q.scales.dtype}{list(q.scales.shape)}')
  if grad.shape != master.shape or grad.dtype not in _GRAD_DTYPES:
    raise ValueError(f'grad must be f32 or bf16 {list(master.shape)}, got '
                     f'{grad.dtype}{list(grad.shape)}')
  if lowp_dtype is not None and jnp.dtype(lowp_dtype) not in _LOWP_DTYPES:
    raise ValueError(f'lowp_dtype must be float32, bfloat16, float16 or None, got {lowp_dtype}')


def adamw8_host(master, mu: ref.Quantized, nu: ref.Quantized, grad, scalars: AdamWScalars, *,
                decayed_rows: int, lowp_dtype: Any = None, nesterov: bool = False,
                num_threads: int | None = None, isa: HostIsa = HostIsa.AUTO):
  """One AdamW step with 8-bit moments on rows of the state, in place, on the host.

  The step of `adamw8_reference.adamw8_step(..., dtype=np.float32)`: decode mu and nu,
  optax.adamw's update from them (the new moments unquantized), the new master, then
  the moments re-encoded with each block's new absolute maximum.

  Args:
    master: f32 (R, S) (or (S,)), updated in place (aliased to the first result).
    mu, nu: `Quantized(codes uint8 (R, S), scales f32 (R, ceil(S / 256)))`, in place.
    grad: f32 or bf16, master's shape; multiplied by `scalars.grad_scale` first.
    scalars: the step's `AdamWScalars`.
    decayed_rows: rows below this index get weight decay.
    lowp_dtype: dtype of the new master's copy written in the same pass (f32, bf16,
      f16), or None for none.
    nesterov: optax's Nesterov variant (needs `scalars.bc1_next`).
    num_threads: threads over the blocks (default: the cores available).
    isa: instruction set of the loop; all give identical results.

  Returns:
    `(master, mu, nu, out)`, out the new master in `lowp_dtype` (master's shape) or None.

  Raises:
    RuntimeError: the native library is missing (`adamw8_kernel_available()` is False).
  """
  if not adamw8_kernel_available():
    raise RuntimeError(adamw8_kernel_unavailable_reason())
  shape = master.shape
  flat = master.ndim == 1
  if flat:
    master, grad = master[None], grad[None]
    mu = ref.Quantized(mu.codes[None], mu.scales[None])
    nu = ref.Quantized(nu.codes[None], nu.scales[None])
  _check(master, mu, nu, grad, lowp_dtype)
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  maps, tables = (jnp.asarray(t) for t in quant_tables())
  out_shape = master.shape if lowp_dtype is not None else (0,)
  out_dtype = jnp.dtype(lowp_dtype) if lowp_dtype is not None else jnp.float32
  state = (master, mu.codes, mu.scales, nu.codes, nu.scales)
  call = jax.ffi.ffi_call(
      _TARGET,
      tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state)
      + (jax.ShapeDtypeStruct(out_shape, out_dtype),),
      input_output_aliases={i: i for i in range(5)})
  p, mc, ms, vc, vs, out = call(
      *state, grad, packed, maps, tables, decayed_rows=np.int64(decayed_rows),
      num_threads=np.int64(threads), nesterov=bool(nesterov), isa=np.int64(int(isa)))
  if flat:
    p, mc, ms, vc, vs = p[0], mc[0], ms[0], vc[0], vs[0]
    out = out[0] if lowp_dtype is not None else out
  return (p.reshape(shape), ref.Quantized(mc, ms), ref.Quantized(vc, vs),
          out if lowp_dtype is not None else None)
