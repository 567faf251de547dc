"""`offloaded`: an optax transform whose state lives in host memory, as subgroups.

`offloaded(inner, offload)` turns an element-wise optax transform into one whose state
is packed into `(G, S)` subgroups in host memory (see `layout`), and whose update runs
each subgroup on the host or on the device according to a `Plan` (see `paths`). The
wrapped transform's own `update` is what runs on each subgroup row, so the math is
optax's, op for op.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dos_jax import clipping
from dos_jax import compiler_options
from dos_jax import meshes
from dos_jax import migration as migration_lib
from dos_jax import validate as validate_lib
from dos_jax.geometry.state import OffloadedState
from dos_jax.implementation import Implementation
from dos_jax.offload import Offload
from dos_jax.policies import Plan
from dos_jax.step import program as program_lib
from dos_jax.step import state_init
from dos_jax.step.adamw_hyperparams import AdamWHyperparams
from dos_jax.step.options import StepOptions

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class ChainRows:
  """The wrapped transform's update of one subgroup row (a `paths.RowUpdate`).

  `advance` steps its scalar state: by name where the transform is AdamW's
  (`adamw`), else by running its update on the zero-length rows it is given (the
  one way to know how an arbitrary element-wise transform steps its scalars).
  """

  inner: optax.GradientTransformationExtraArgs
  adamw: AdamWHyperparams | None = None

  def __call__(self, grad, state, param, decayed):
    return self.inner.update(grad, state, param, row_decayed=decayed)

  def advance(self, inner_state, state_dtype):
    if self.adamw is not None:
      return self.adamw.advance(inner_state)
    zero = jnp.zeros((0,), state_dtype)
    return self(zero, inner_state, zero, True)[1]


def offloaded(
    inner: optax.GradientTransformationExtraArgs | AdamWHyperparams,
    offload: Offload | None = None,
    *,
    implementation: Implementation | None = None,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    validate: Callable[[PyTree], None] | None = None,
    shard_dims: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Runs an element-wise optax transform on host-resident subgroups.

  Args:
    inner: an element-wise transform; its update is applied to each subgroup row with
      the extra keyword `row_decayed` (whether the row holds weight-decayed leaves).
      Or AdamW's hyperparameters (`AdamWHyperparams`, what `dos_jax.adamw` passes):
      then its `chain()` is the transform, and the host path may run as one native
      call (`Implementation.host`, see `capability`).
    offload: subgroup size, placement policy, mesh; `None` means `Offload()`.
    implementation: the program `init` builds the state for and the code that runs
      the updates (tests, benchmarks); `None` means `Implementation()`: the backend's
      program, the kernels where they are available.
    mask: weight-decay mask (pytree or callable) used to group decayed leaves.
    validate: called with the params at `init`, to reject unsupported transforms early.
    shard_dims: ZeRO-3, params split over `offload.data_axis`: per leaf (a pytree or a
      callable of the params) the dimension split over it, or None. Given, the state
      is packed shard-major on a mesh (see `layout`): each device packs and unpacks its
      own shards of the leaves, and no row is gathered.

  Returns:
    A transform whose update also accepts `plan=` (a `Plan`, static under jit: by
    default the state's own, `state.partition.plan`; another one must be moved in with
    `dos_jax.migrate` first, which an eager update does itself), and `grad_scale=` (a scalar, e.g. a
    global-norm clip factor) that multiplies every gradient, in fp32, on whichever path
    updates it.
  """
  validate_lib.check_offload(offload, 'dos_jax.offloaded')
  validate_lib.check_implementation(implementation, 'dos_jax.offloaded')
  offload = Offload() if offload is None else offload
  implementation = Implementation() if implementation is None else implementation
  adamw = inner if isinstance(inner, AdamWHyperparams) else None
  inner = inner if adamw is None else adamw.chain()
  kernels = program_lib.StepKernels(row_update=ChainRows(inner, adamw), adamw=adamw,
                                    options=StepOptions.of(offload, implementation))

  def init_fn(params):
    if validate_lib.is_params_placeholder(params):
      # optax.tree_utils.tree_map_params: the packed state holds no params-shaped tree.
      return validate_lib.NOT_PARAMS_SHAPED
    validate_lib.check_params(params)
    validate_lib.warn_if_uncommitted(params)
    compiler_options.xla_flags_async_compute_limit()  # a bad value named now, not in a trace
    if validate is not None:
      validate(params)
    return state_init.init_state(inner, offload, params, implementation=implementation,
                                 mask=mask, shard_dims=shard_dims, adamw=adamw)

  def update_fn(updates, state: OffloadedState, params=None, *, plan: Plan | None = None,
                grad_scale: jax.Array | float | None = None, **extra_args):
    del extra_args
    state = _checked_state(state, params, plan)
    layout = state.layout
    grad_leaves = validate_lib.leaves_like(updates, layout, 'updates')
    param_leaves = None if params is None else validate_lib.leaves_like(params, layout, 'params')
    # What the state was built for (mesh, params' shardings, program) comes with it: any
    # transform built alike steps it the same (a fresh one after a restart, or the one
    # `optax.inject_hyperparams` builds at every update).
    sharded = state.sharded
    where = state_init.placement(None if sharded is None else sharded.mesh, offload.data_axis)
    if grad_scale is not None:
      grad_scale = jnp.asarray(grad_scale, layout.state_dtype)
    explicit = meshes.explicit_mesh(grad_leaves + (param_leaves or []))
    if explicit is None:
      new_leaves, new_state = program_lib.run_step(
          kernels, grad_leaves, param_leaves, state, grad_scale, sharded=sharded, where=where)
    else:
      body = functools.partial(program_lib.run_step, kernels, sharded=sharded, where=where)
      new_leaves, new_state = _in_auto_axes(explicit, body, grad_leaves, param_leaves, state,
                                            grad_scale, offload.data_axis)
    # The updates take the structure of the updates given (optax's convention), not
    # the init-time one: node types may differ (nnx.Param at init, arrays here).
    return jax.tree.structure(updates).unflatten(new_leaves), new_state

  return clipping.mark_offloaded(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _in_auto_axes(explicit, body, grad_leaves, param_leaves, state: OffloadedState,
                  grad_scale, data_axis: str):
  """`body(grad_leaves, param_leaves, state, grad_scale)` under a mesh with Explicit axes
  (sharding in types, `explicit`), inside `auto_axes`: the packing concatenates leaves
  sharded unlike each other, which Explicit axes refuse; there XLA chooses, as with
  Auto axes."""
  def spec(leaf):
    return getattr(getattr(jax.typeof(leaf), 'sharding', None), 'spec', P())

  out_specs = ([spec(x) for x in (param_leaves or grad_leaves)],
               meshes.state_specs(state, explicit, data_axis))
  with jax.sharding.use_abstract_mesh(explicit):
    return jax.sharding.auto_axes(body, out_sharding=out_specs)(
        grad_leaves, param_leaves, state, grad_scale)


def _checked_state(state, params, plan: Plan | None) -> OffloadedState:
  """`state`, checked, laid out for `plan` (None: its own, `state.partition.plan`): the
  step then depends on the state alone. Another plan is moved in eagerly; traced, it is
  a one-line error (move it between steps with `dos_jax.migrate`)."""
  if not isinstance(state, OffloadedState):
    raise TypeError(f'dos_jax: expected an OffloadedState, got {type(state).__name__}')
  plan = state.partition.plan if plan is None else plan
  migration_lib.check_plan(plan, state)
  if params is None and state.layout.needs_master:
    raise ValueError(
        'dos_jax: params are required: updates are computed against the fp32 master.'
    )
  if migration_lib.partition_for(plan, state) != state.partition:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
      raise ValueError(
          f'dos_jax: the state is laid out for another plan than this step\'s'
          f' ({plan.describe()}); move its rows first, between steps:'
          ' opt_state = dos_jax.migrate(opt_state, plan)')
    state = migration_lib.migrate_state(state, plan)
  return state
