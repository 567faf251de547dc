"""AdamW written once: `AdamWHyperparams` is the one description `dos_jax.adamw` is
built from. Its `chain()` is the optax chain the XLA paths run row by row; its
`scalars` and `advance` read and step that chain's scalar state (the step counts) by
the type of each member's state, never by its position in the chain.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

from dos_jax.kernels.adamw_scalars import AdamWScalars


def decay_where_row(weight_decay: float | jax.Array) -> optax.GradientTransformationExtraArgs:
  """`optax.add_decayed_weights` for one subgroup row: decays only rows of decayed leaves.

  The layout packs masked-in leaves into whole subgroups, so the mask becomes the
  per-row flag `row_decayed` that the offloaded update passes in.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, row_decayed=True, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    decayed = jax.tree.map(
        lambda u, p: jnp.where(row_decayed, u + weight_decay * p, u), updates, params
    )
    return decayed, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _states(inner_state, kind: type) -> list:
  """The members of `inner_state` (a chain's state) of type `kind`."""
  return [s for s in inner_state if isinstance(s, kind)]


@dataclasses.dataclass(frozen=True, eq=False)
class AdamWHyperparams:
  """AdamW's hyperparameters, `optax.adamw`'s arguments: the chain the XLA paths run
  and the native and Pallas kernels' scalars both come from here.

  Values may be Python floats or (under `optax.inject_hyperparams`) arrays; the
  learning rate may be a schedule.

  Example:
    >>> import jax.numpy as jnp
    >>> hp = AdamWHyperparams(learning_rate=1e-3)
    >>> state = hp.chain().init(jnp.zeros(3))
    >>> round(float(hp.scalars(state).bc1), 6)  # 1 - b1 ** 1, at the first step
    0.1
  """

  learning_rate: optax.ScalarOrSchedule
  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  weight_decay: Any = 1e-4
  nesterov: bool = False
  mu_dtype: Any = None

  def chain(self) -> optax.GradientTransformationExtraArgs:
    """`optax.adamw`'s math for one subgroup row: `scale_by_adam`, the decay of decayed
    rows (`decay_where_row`), `scale_by_learning_rate`."""
    return optax.chain(
        optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
                            mu_dtype=self.mu_dtype, nesterov=self.nesterov),
        decay_where_row(self.weight_decay),
        optax.scale_by_learning_rate(self.learning_rate),
    )

  def advance(self, inner_state):
    """`chain()`'s state after one step, as far as its scalars go: every step count
    incremented as its transform does (`safe_increment`); the moments are left as
    they are (only the scalar leaves of the result are read)."""
    def step(state):
      if isinstance(state, (optax.ScaleByAdamState, optax.ScaleByScheduleState)):
        return state._replace(count=numerics.safe_increment(state.count))
      return state
    return tuple(step(s) for s in inner_state)

  def scalars(self, inner_state) -> AdamWScalars:
    """The step's `AdamWScalars` from `chain()`'s state before the step."""
    (adam,) = _states(inner_state, optax.ScaleByAdamState)
    count = numerics.safe_increment(adam.count)  # scale_by_adam's count in the step
    if callable(self.learning_rate):
      # scale_by_schedule evaluates the schedule at its count before the step.
      (schedule,) = _states(inner_state, optax.ScaleByScheduleState)
      lr = self.learning_rate(schedule.count)
    else:
      lr = self.learning_rate
    # optax.tree.bias_correction: `1 - decay**count` with the incremented count.
    return AdamWScalars(
        lr=lr, b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
        weight_decay=self.weight_decay, bc1=1 - self.b1**count, bc2=1 - self.b2**count,
        bc1_next=(1 - self.b1**numerics.safe_increment(count)) if self.nesterov else None)
