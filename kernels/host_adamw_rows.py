"""Native AdamW over chosen subgroup rows of the stacked state, in place, in one call.

The offloaded transform stores its fp32 state as one `(G, K, S)` array: per subgroup,
K rows of S elements holding the master weights (for 16-bit params), `mu` and `nu`
(see `dos_jax.geometry.slots`). `adamw_host_rows` updates the subgroups listed in `rows` with
the native host kernel (host_adamw_rows.cc, whose element loop, adamw_loop.h, agrees
with `jax.jit(optax.adamw)` bit for bit). The state is aliased
input to output: under jit with the state donated, nothing state-sized is copied or
allocated, and subgroups not listed keep their bytes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dos_jax.kernels import _native
from dos_jax.kernels import adamw_scalars
from dos_jax.kernels import plugin_kernel
from dos_jax.kernels.adamw_scalars import AdamWScalars
from dos_jax.kernels.host_adamw import check_threads_and_isa
from dos_jax.kernels.host_adamw import GRAD_DTYPES
from dos_jax.kernels.host_adamw import LOWP_DTYPES
from dos_jax.kernels.host_adamw import HostIsa

_TARGET = 'dos_jax_adamw_host_rows'
_TARGET_OUT_IN = 'dos_jax_adamw_host_rows_out_in'  # also takes a buffer to alias to out
_TARGET_LEAVES = 'dos_jax_adamw_host_leaves'  # gradients read from the tree's leaves
_TARGET_STATE_ARG = 'dos_jax_adamw_host_leaves_state_arg'  # state updated in its argument
# The same, keeping an undo copy of what it overwrites; and the redo that uses it.
_TARGET_STATE_ARG_UNDO = 'dos_jax_adamw_host_leaves_state_arg_undo'
_TARGET_REDO = 'dos_jax_adamw_host_leaves_redo'
# FFI target -> the native module's function returning its handler.
_HANDLERS = {_TARGET: 'handler', _TARGET_OUT_IN: 'handler_out_in',
             _TARGET_LEAVES: 'handler_leaves',
             _TARGET_STATE_ARG: 'handler_leaves_state_arg',
             _TARGET_STATE_ARG_UNDO: 'handler_leaves_state_arg_undo',
             _TARGET_REDO: 'handler_leaves_redo'}



@functools.cache
def _load() -> tuple[Any, str]:
  """Imports the native module and registers its FFI targets; (module, '') or (None, why)."""
  return _native.load('_host_adamw_rows', _HANDLERS, 'native row-wise host AdamW')


def rows_kernel_available() -> bool:
  """Whether the row-wise native host AdamW is built, loadable and registered."""
  return _load()[0] is not None


def rows_kernel_unavailable_reason() -> str:
  """Why `rows_kernel_available()` is False ('' when it is True)."""
  return _load()[1]


# The process's standing of the handlers inside GPU plugins (tests put others here).
_WARNING = ("dos_jax: the native host AdamW cannot be used inside GPU programs (%s); host "
            "subgroups use XLA's host loop instead, several times slower (4-7x in "
            "experiments/notes/results_kernels2.md). The library was built against XLA FFI "
            "API %s.%s.")
_PLUGIN = plugin_kernel.PluginKernel(_load, _HANDLERS, _WARNING)
NO_CUDA_BACKEND = plugin_kernel.NO_CUDA_BACKEND


def host_kernel_in_gpu_programs() -> tuple[bool, str]:
  """Whether host regions of GPU programs may call the native kernel: `(ok, why not)`.

  True only when the handlers were registered in the CUDA plugin and a probe compile
  proved it took them (`plugin_kernel.PluginKernel`), for the process's live CUDA
  backend or, with no GPU, after `register_for_gpu_compile`. `(False, NO_CUDA_BACKEND)`
  when neither exists; `(False, why)` when the kernel is missing or the plugin cannot be
  shown to have it: the caller gives host subgroups XLA's host loop, and the process
  logs one warning.
  """
  return _PLUGIN.in_gpu_programs()


def host_kernel_in_two_memory_programs() -> tuple[bool, str]:
  """Whether a two-memory program (`Implementation(program='gpu')`, or a GPU
  backend's) traced now may call the native kernel in its host regions: `(ok, why not)`
  (on the CPU backend: whenever the kernel is available)."""
  return _PLUGIN.in_two_memory_programs()


def register_for_gpu_compile() -> tuple[bool, str]:
  """Registers the handlers in the CUDA plugin for compiling GPU programs without a GPU
  (`dos_jax.dataflow.compile_for_gpu`) and proves it took them: `(True, '')` or
  `(False, why)` (then one warning, and host regions take XLA's host loop). A program
  traced after this call puts the native kernel in its host regions."""
  return _PLUGIN.register_for_gpu_compile()


def _check(stacked, grads, params, rows, slots, out, lowp_dtype, indexed) -> None:
  """Raises a one-line error naming the argument that breaks the contract."""
  if stacked.ndim != 3 or stacked.dtype != jnp.float32:
    raise ValueError(f'stacked must be f32 (G, K, S), got {stacked.dtype}{list(stacked.shape)}')
  num_groups, k, size = stacked.shape
  if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f'rows must be a 1-D integer array, got {rows.dtype}{list(rows.shape)}')
  io_rows = num_groups if indexed else rows.shape[0]
  form = '(G, S) since indexed=True' if indexed else '(R, S), R = len(rows)'
  if grads.shape != (io_rows, size) or grads.dtype not in GRAD_DTYPES:
    raise ValueError(f'grads must be f32 or bf16 {form} = {(io_rows, size)}, got '
                     f'{grads.dtype}{list(grads.shape)}')
  master_k, mu_k, nu_k = slots
  used = [s for s in slots if s >= 0]
  if len(set(used)) != len(used) or any(s >= k for s in used) or min(mu_k, nu_k) < 0:
    raise ValueError(f'slots={slots} must be distinct rows in [0, {k}) (master may be -1)')
  if master_k < 0:
    if params is None or params.shape != (io_rows, size) or params.dtype != jnp.float32:
      got = None if params is None else f'{params.dtype}{list(params.shape)}'
      raise ValueError(f'without a master slot, params must be f32 {form}, got {got}')
    if jnp.dtype(lowp_dtype) != jnp.float32:
      raise ValueError(f'without a master slot the out rows are the f32 update; '
                       f'lowp_dtype must be float32, got {jnp.dtype(lowp_dtype)}')
  if jnp.dtype(lowp_dtype) not in LOWP_DTYPES:
    raise ValueError(f'lowp_dtype must be float32, bfloat16 or float16, got {lowp_dtype}')
  if out is not None and (out.shape != (io_rows, size) or out.dtype != jnp.dtype(lowp_dtype)):
    raise ValueError(f'out must be {jnp.dtype(lowp_dtype).name} {form}, got '
                     f'{out.dtype}{list(out.shape)}')


def adamw_host_rows(stacked, grads, params, rows, scalars: AdamWScalars, *,
                    slots: tuple[int, int, int], decayed_rows: int, lowp_dtype: Any,
                    out=None, indexed: bool = False, nesterov: bool = False,
                    num_threads: int | None = None, isa: HostIsa = HostIsa.AUTO):
  """One AdamW step on subgroups `rows` of the stacked state, in place, on the host.

  Per element, optax.adamw's op order in fp32: g = grad * grad_scale;
  mu' = (1-b1) g + b1 mu; nu' = (1-b2) g^2 + b2 nu; u = (mu'/bc1) / (sqrt(nu'/bc2 +
  eps_root) + eps); u += weight_decay * p on subgroups g < decayed_rows; u = -lr u;
  master' = master + u.

  Args:
    stacked: f32 `(G, K, S)` state; updated in place (aliased to the first result).
    grads: f32 or bf16 gradient rows: `(R, S)` with row j belonging to subgroup
      `rows[j]`, or `(G, S)` indexed by subgroup when `indexed`.
    params: None when the master is in `stacked`; else the f32 param rows, in the
      same form as `grads`.
    rows: int `(R,)` distinct subgroup indices to update.
    scalars: the step's `AdamWScalars`.
    slots: `(master_k, mu_k, nu_k)`, rows of the K axis; master_k = -1 when params
      are fp32 and there is no master.
    decayed_rows: subgroups below this index get weight decay.
    lowp_dtype: dtype of the out rows: the new master cast to it (bf16, f16 or f32),
      or, without a master, float32 (the out rows are the update u).
    out: optional buffer of the out rows' form, aliased to the second result; with
      `indexed`, rows not in `rows` keep its values (e.g. the device path's rows).
    indexed: grads, params and out are `(G, S)` indexed by subgroup (no gather or
      scatter of the host rows needed) rather than `(R, S)` in the order of `rows`.
    nesterov: Nesterov momentum (needs `scalars.bc1_next`).
    num_threads: threads over all R * S elements (default: the cores available).
    isa: instruction set of the loop; all give identical results.

  Returns:
    `(new_stacked, new_out)`.

  Raises:
    RuntimeError: the native library is missing (`rows_kernel_available()` is False).
  """
  if not rows_kernel_available():
    raise RuntimeError(rows_kernel_unavailable_reason())
  host_kernel_in_gpu_programs()  # registers in a GPU plugin first, if there is one
  rows = jnp.asarray(rows)
  _check(stacked, grads, params, rows, slots, out, lowp_dtype, indexed)
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  if params is None:
    params = jnp.zeros((0,), jnp.float32)
  num_groups, _, size = stacked.shape
  io_rows = num_groups if indexed else rows.shape[0]
  reuse = out is not None
  call = jax.ffi.ffi_call(
      _TARGET_OUT_IN if reuse else _TARGET,
      (jax.ShapeDtypeStruct(stacked.shape, stacked.dtype),
       jax.ShapeDtypeStruct((io_rows, size), jnp.dtype(lowp_dtype))),
      input_output_aliases={0: 0, **({5: 1} if reuse else {})},
  )
  args = (stacked, grads, params, rows.astype(jnp.int32), packed) + ((out,) if reuse else ())
  master_k, mu_k, nu_k = (int(s) for s in slots)
  return tuple(call(
      *args, master_k=np.int64(master_k), mu_k=np.int64(mu_k), nu_k=np.int64(nu_k),
      decayed_rows=np.int64(decayed_rows), indexed=bool(indexed),
      num_threads=np.int64(threads), nesterov=bool(nesterov), isa=np.int64(int(isa))))


def _checked_leaves(grad_leaves, param_leaves, offsets, master_k: int, elements: int):
  """The leaves flattened, checked against `offsets` (one per leaf, no overlap, inside
  the state's `elements`): (grad leaves, param leaves, offsets, sizes, leaf order by
  offset)."""
  grad_leaves = [jnp.ravel(g) for g in grad_leaves]
  sizes = [int(g.shape[0]) for g in grad_leaves]
  offsets = [int(o) for o in offsets]
  if not grad_leaves or len(offsets) != len(grad_leaves):
    raise ValueError(f'one offset per gradient leaf: {len(offsets)} offsets, '
                     f'{len(grad_leaves)} leaves')
  dtypes = {g.dtype for g in grad_leaves}
  if len(dtypes) != 1 or dtypes.pop() not in GRAD_DTYPES:
    raise ValueError(f'gradient leaves must all be f32 or all bf16, got '
                     f'{sorted({g.dtype.name for g in grad_leaves})}')
  order = sorted(range(len(offsets)), key=offsets.__getitem__)
  for a, b in zip(order, order[1:]):
    if offsets[a] + sizes[a] > offsets[b]:
      raise ValueError(f'leaves {a} and {b} overlap: offsets {offsets[a]}, {offsets[b]}')
  if offsets[order[0]] < 0 or offsets[order[-1]] + sizes[order[-1]] > elements:
    raise ValueError(f'leaves reach beyond the state\'s {elements} elements')
  if master_k < 0:
    if param_leaves is None or len(param_leaves) != len(grad_leaves):
      raise ValueError('without a master slot, params must be one f32 leaf per gradient leaf')
    param_leaves = [jnp.ravel(p) for p in param_leaves]
    if any(p.dtype != jnp.float32 or p.shape[0] != n for p, n in zip(param_leaves, sizes)):
      raise ValueError('param leaves must be f32 and the size of their gradient leaves')
  return grad_leaves, param_leaves, offsets, sizes, order


def adamw_host_leaves(stacked, grad_leaves, param_leaves, rows, scalars: AdamWScalars, *,
                      offsets, slots: tuple[int, int, int], decayed_rows: int,
                      lowp_dtype: Any, out=None, nesterov: bool = False,
                      num_threads: int | None = None, isa: HostIsa = HostIsa.AUTO,
                      state_in_arg: bool = False,
                      keep_undo: bool = False):
  """`adamw_host_rows` reading gradients (and params) from the parameter tree's leaves.

  The packed `(G, S)` gradient (and param) rows are never built: leaf i supplies the
  elements `[offsets[i], offsets[i] + leaf.size)` of the flat `G * S` vector, the
  layout's packing. Elements no leaf covers are padding, zero in the state, and are
  left alone (in `out` too: they are never read from it). Out rows are `(G, S)`,
  indexed by subgroup, as with `indexed=True`.

  Args:
    grad_leaves: gradient leaves, one dtype (f32 or bf16), any shapes.
    param_leaves: None with a master slot; else the f32 param leaves, same shapes.
    offsets: static ints, the flat offset of each leaf; leaves must not overlap.
    state_in_arg: update the state in the buffer of the `stacked` argument and return
      only the out rows: the call has no state result, so XLA sees `stacked` unchanged.
      For a host region of the two-memory program only, where XLA gives the region's
      results buffers of their own and would copy a state result back into the donated
      state on every step (see `dos_jax.step.kernel_calls.host_region_update`). The caller owns the
      ordering: `stacked` must be a buffer it may overwrite (the donated state), read
      only after the call. Not with `out`.
    keep_undo: with `state_in_arg`, also keep a copy of every state element the call
      overwrites, taken just before, in the kernel library (found by the state
      buffer's address, not a result): what `adamw_host_leaves_redo` on the same
      buffer needs to put the state back. A result would be device memory in XLA:GPU
      when the redo's host call reads it (`dos_jax.step.early_calls`).
    Others as `adamw_host_rows`.

  Returns:
    `(new_stacked, new_out)` with new_out `(G, S)`; with `state_in_arg` only new_out.
  """
  if not rows_kernel_available():
    raise RuntimeError(rows_kernel_unavailable_reason())
  host_kernel_in_gpu_programs()  # registers in a GPU plugin first, if there is one
  rows = jnp.asarray(rows)
  num_groups, _, size = stacked.shape
  master_k = slots[0]
  grad_leaves, param_leaves, offsets, sizes, order = _checked_leaves(
      grad_leaves, param_leaves, offsets, master_k, num_groups * size)
  fake = jax.ShapeDtypeStruct((num_groups, size), grad_leaves[0].dtype)
  _check(stacked, fake, None if master_k >= 0 else
         jax.ShapeDtypeStruct((num_groups, size), jnp.float32), rows, slots, out, lowp_dtype,
         indexed=True)
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  sources = [grad_leaves[i] for i in order]
  if master_k < 0:
    sources += [param_leaves[i] for i in order]
  _, mu_k, nu_k = (int(s) for s in slots)
  common = dict(
      offsets=np.asarray([offsets[i] for i in order], np.int64),
      sizes=np.asarray([sizes[i] for i in order], np.int64), master_k=np.int64(master_k),
      mu_k=np.int64(mu_k), nu_k=np.int64(nu_k), decayed_rows=np.int64(decayed_rows),
      num_threads=np.int64(threads), nesterov=bool(nesterov), isa=np.int64(int(isa)))
  if keep_undo and not state_in_arg:
    raise ValueError('keep_undo needs state_in_arg')
  if state_in_arg:
    if out is not None:
      raise ValueError('state_in_arg takes no out buffer')
    call = jax.ffi.ffi_call(
        _TARGET_STATE_ARG_UNDO if keep_undo else _TARGET_STATE_ARG,
        jax.ShapeDtypeStruct((num_groups, size), jnp.dtype(lowp_dtype)),
        has_side_effect=True)
    return call(stacked, rows.astype(jnp.int32), packed, *sources, **common)
  reuse = out is not None
  call = jax.ffi.ffi_call(
      _TARGET_LEAVES,
      (jax.ShapeDtypeStruct(stacked.shape, stacked.dtype),
       jax.ShapeDtypeStruct((num_groups, size), jnp.dtype(lowp_dtype))),
      input_output_aliases={0: 0, **({3 + len(sources): 1} if reuse else {})},
  )
  args = (stacked, rows.astype(jnp.int32), packed, *sources) + ((out,) if reuse else ())
  return tuple(call(*args, out_in=reuse, **common))


def adamw_host_leaves_redo(stacked, grad_leaves, param_leaves, rows, scalars: AdamWScalars,
                           *, redo, offsets, slots: tuple[int, int, int],
                           decayed_rows: int, lowp_dtype: Any, nesterov: bool = False,
                           num_threads: int | None = None, isa: HostIsa = HostIsa.AUTO):
  """Redoes an `adamw_host_leaves(..., state_in_arg=True, keep_undo=True)` call on the
  same `stacked` buffer when `redo` is true: every element it updated is put back from
  the copy it kept and updated again with `scalars`, the state in the buffer of
  `stacked` (an argument: the caller's to overwrite, read only after this call) and the
  out rows in a `(G, S)` result. With `redo` false nothing is touched and the out result
  is not written: the caller keeps the out rows of the call it would have redone. Either
  way the kept copy is handed back to the library (one redo per speculated call; a redo
  with no speculated call before it on that buffer fails). Returns the out rows; the
  caller orders its reads of the state after the call through them, and this call after
  the speculated one. Same leaves, offsets, rows and slots as the call it redoes (for a
  host region of the two-memory program only, like `state_in_arg`).
  """
  if not rows_kernel_available():
    raise RuntimeError(rows_kernel_unavailable_reason())
  host_kernel_in_gpu_programs()
  num_groups, _, size = stacked.shape
  grad_leaves = [jnp.ravel(g) for g in grad_leaves]
  sizes = [int(g.shape[0]) for g in grad_leaves]
  offsets = [int(o) for o in offsets]
  order = sorted(range(len(offsets)), key=offsets.__getitem__)
  master_k, mu_k, nu_k = (int(s) for s in slots)
  sources = [grad_leaves[i] for i in order]
  if master_k < 0:
    sources += [jnp.ravel(param_leaves[i]) for i in order]
  threads, isa = check_threads_and_isa(num_threads, isa)
  packed = adamw_scalars.pack(adamw_scalars.coefficients(scalars, nesterov=nesterov))
  call = jax.ffi.ffi_call(
      _TARGET_REDO, jax.ShapeDtypeStruct((num_groups, size), jnp.dtype(lowp_dtype)),
      has_side_effect=True)
  flag = jnp.reshape(jnp.asarray(redo).astype(jnp.int32), (1,))
  return (call(
      stacked, jnp.asarray(rows).astype(jnp.int32), packed, *sources, flag,
      offsets=np.asarray([offsets[i] for i in order], np.int64),
      sizes=np.asarray([sizes[i] for i in order], np.int64), master_k=np.int64(master_k),
      mu_k=np.int64(mu_k), nu_k=np.int64(nu_k), decayed_rows=np.int64(decayed_rows),
      num_threads=np.int64(threads), nesterov=bool(nesterov), isa=np.int64(int(isa))))
