"""Block-wise 8-bit AdamW moments, in numpy: the format's definition and its reference step.

The format of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022),
as bitsandbytes' `AdamW8bit` stores it: a moment is cut into blocks of `BLOCK_SIZE`
consecutive elements (along the last axis); a block keeps one fp32 scale, its absolute
maximum, and one uint8 code per element, the index of the entry of a 256-entry sorted
code map nearest to `x / scale` (ties to the lower index). The first moment uses the
signed dynamic map, the second the unsigned one. Decoding is `map[code] * scale` in
fp32 (one rounding).

The dynamic map (the paper's dynamic tree quantization as bitsandbytes'
`create_dynamic_map` builds it, 7 exponent levels): for level i = 0..6 the midpoints of
n_i equal bins of [0.1, 1], times 10^(i - 6), with n_i = 2^i (signed: and their
negatives) or 2^(i + 1) (unsigned: the sign bit is one more fraction bit); then 0 and
1. Each has 256 entries: signed 127 negative, 0, 127 positive and 1; unsigned 0, 254
positive and 1. The values are computed here in float64 and stored rounded to fp32 (up
to 2 fp32 ulps from bitsandbytes' float32 construction; tests/test_adamw8_reference.py).

Everything computes in float64 unless asked otherwise; `adamw8_step(..., dtype=np.float32)`
is the same step with every operation rounded to fp32 in the native kernel's order, which
the kernels match bit for bit.

Example:
  >>> import numpy as np
  >>> from dos_jax.kernels import adamw8_reference as ref
  >>> x = np.array([0.5, -0.25, 0.0, 1e-3], np.float32)
  >>> q = ref.quantize(x, ref.code_map(signed=True))
  >>> float(q.scales[0])
  0.5
  >>> np.round(ref.dequantize(q, ref.code_map(signed=True)), 4).tolist()
  [0.5, -0.2504, 0.0, 0.0009]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

BLOCK_SIZE = 256  # elements per scale: bitsandbytes' blockwise optimizers (optim/optimizer.py)
EXPONENT_LEVELS = 7  # bitsandbytes' max_exponent_bits for 8 bits


class Quantized(NamedTuple):
  """One moment in the 8-bit format."""

  codes: np.ndarray  # uint8 (..., S): indices into the code map
  scales: np.ndarray  # float32 (..., ceil(S / block_size)): each block's absolute maximum


def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 values of the dynamic map, float64, sorted ascending (see the module doc)."""
  values = [0.0, 1.0]
  for level in range(EXPONENT_LEVELS):
    bins = 2**level if signed else 2**(level + 1)
    edges = np.linspace(0.1, 1.0, bins + 1)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0**(level - (EXPONENT_LEVELS - 1))
    values += list(means) + (list(-means) if signed else [])
  out = np.sort(np.asarray(values, np.float64))
  assert out.shape == (256,), out.shape
  return out


@functools.cache
def _code_map(signed: bool) -> np.ndarray:
  table = dynamic_map(signed).astype(np.float32)
  table.setflags(write=False)
  return table


def code_map(signed: bool) -> np.ndarray:
  """The stored map: `dynamic_map(signed)` rounded to float32 (read-only, 256 entries)."""
  return _code_map(bool(signed))


def num_blocks(size: int, block_size: int = BLOCK_SIZE) -> int:
  """Blocks (scales) of a row of `size` elements."""
  return -(-size // block_size)


def _blocks(x: np.ndarray, block_size: int) -> np.ndarray:
  """x (..., S) zero-padded to (..., B, block_size)."""
  size = x.shape[-1]
  pad = num_blocks(size, block_size) * block_size - size
  x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], -1, block_size)


def nearest_code(normalized: np.ndarray, table: np.ndarray) -> np.ndarray:
  """uint8 index of the entry of `table` nearest to each value, ties to the lower index.

  The midpoints of adjacent fp32 entries are exact in float64; the code is the number of
  midpoints strictly below the value.
  """
  t = table.astype(np.float64)
  midpoints = (t[:-1] + t[1:]) / 2
  return np.searchsorted(midpoints, np.asarray(normalized, np.float64), side='left').astype(
      np.uint8)


def quantize(x: np.ndarray, table: np.ndarray, block_size: int = BLOCK_SIZE) -> Quantized:
  """Block-wise quantization of `x` (..., S) along its last axis.

  scale = max |x| over the block, rounded to float32 (exact for float32 x); code =
  nearest_code(x / scale), computed in float64; a block of zeros has scale 0 and the
  code of 0.
  """
  x = np.asarray(x)
  size = x.shape[-1]
  blocks = _blocks(x.astype(np.float64), block_size)
  scales = np.max(np.abs(blocks), axis=-1).astype(np.float32)
  s = scales.astype(np.float64)[..., None]
  normalized = np.divide(blocks, s, out=np.zeros_like(blocks), where=s > 0)
  codes = nearest_code(normalized, table).reshape(*x.shape[:-1], -1)[..., :size]
  return Quantized(codes, scales)


def dequantize(q: Quantized, table: np.ndarray, block_size: int = BLOCK_SIZE) -> np.ndarray:
  """map[code] * scale, float64: exact (a product of two fp32 values); its float32
  rounding is what the kernels decode a moment to."""
  size = q.codes.shape[-1]
  values = table.astype(np.float64)[q.codes]
  scales = np.repeat(q.scales.astype(np.float64), block_size, axis=-1)[..., :size]
  return values * scales


def zeros(shape: tuple[int, ...], block_size: int = BLOCK_SIZE) -> tuple[Quantized, Quantized]:
  """The initial (mu, nu): every element 0 (codes of 0, scales 0)."""
  *lead, size = shape
  scales = np.zeros((*lead, num_blocks(size, block_size)), np.float32)
  mu_zero = int(np.flatnonzero(code_map(True) == 0)[0])
  return (Quantized(np.full(shape, mu_zero, np.uint8), scales.copy()),
          Quantized(np.zeros(shape, np.uint8), scales.copy()))


def adamw8_step(master, mu: Quantized, nu: Quantized, grad, *, lr, b1, b2, eps, eps_root,
                weight_decay, bc1, bc2, decay_limit, grad_scale=1.0, nesterov=False,
                bc1_next=None, dtype=np.float64, block_size: int = BLOCK_SIZE,
                with_moments: bool = False):
  """One AdamW step with 8-bit moments and a master in `dtype`, on rows (..., S).

  Decodes mu and nu, takes optax.adamw's step from them (for optax: mu and nu are the
  decoded moments, bc1 = 1 - b1^count, bc2 = 1 - b2^count of the incremented count):
    g = grad * grad_scale; m = (1 - b1) g + b1 mu; v = (1 - b2) g^2 + b2 nu
    m_hat = m / bc1 (nesterov: b1 m / bc1_next + (1 - b1) g / bc1); v_hat = v / bc2
    u = m_hat / (sqrt(v_hat + eps_root) + eps) (+ weight_decay * master where the last
    axis index < decay_limit); master' = master - lr u
  and stores m and v in the 8-bit format (`quantize`). The update uses m and v before
  quantization, as bitsandbytes' 8-bit optimizers do.

  With dtype=np.float32 every operation is rounded to fp32 in the order above, the
  divisions by bc1 and bc2 being products with their fp32 reciprocals, and the decoded
  moments fp32; the scalars are rounded to fp32 first (1 - b1 in float64, then rounded).

  Returns:
    (new master in `dtype`, new mu, new nu), and with `with_moments` also the new m and
    v before quantization (in `dtype`).
  """
  f = np.dtype(dtype).type
  one = f(1)
  c = dict(lr=f(lr), b1=f(b1), omb1=f(1.0 - b1), b2=f(b2), omb2=f(1.0 - b2), eps=f(eps),
           eps_root=f(eps_root), wd=f(weight_decay), gscale=f(grad_scale),
           inv_bc1=one / f(bc1), inv_bc2=one / f(bc2),
           inv_bc1_next=one / f(bc1_next) if nesterov else f(0))
  p = np.asarray(master).astype(dtype)
  m0 = dequantize(mu, code_map(True), block_size).astype(dtype)
  v0 = dequantize(nu, code_map(False), block_size).astype(dtype)
  g = np.asarray(grad).astype(np.float32).astype(dtype) * c['gscale']
  m = c['omb1'] * g + c['b1'] * m0
  v = c['omb2'] * (g * g) + c['b2'] * v0
  if nesterov:
    m_hat = c['b1'] * (m * c['inv_bc1_next']) + c['omb1'] * (g * c['inv_bc1'])
  else:
    m_hat = m * c['inv_bc1']
  u = m_hat / (np.sqrt(v * c['inv_bc2'] + c['eps_root']) + c['eps'])
  decayed = np.arange(p.shape[-1]) < decay_limit
  u = np.where(decayed, u + c['wd'] * p, u)
  new_p = p + (-c['lr']) * u
  out = (new_p.astype(dtype), quantize(m, code_map(True), block_size),
         quantize(v, code_map(False), block_size))
  return out + (m, v) if with_moments else out
