"""Orbax checkpoints of a run: params, optimizer state, step, data position.

The optimizer state is saved as layout-independent pytrees shaped like the params
(`dos_jax.state_to_pytrees`: master weights, moments, count), not as the packed
subgroups, so a run can resume under another placement policy or subgroup size;
`dos_jax.state_from_pytrees` re-packs them and places them in `pinned_host` memory.
(Both go through device memory today, in the core: fine on CPU and for models whose
state fits the device; for 7B+ on a GPU they need a host-side unpack/pack.)

Orbax writes each checkpoint into a temporary directory and renames it when complete,
so a process killed mid-save leaves no checkpoint that looks finished; leftover
temporary directories are removed when the manager next opens the directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

import dos_jax


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `Checkpointer.restore` returns."""

  step: int
  params: Any
  opt_state: Any
  meta: dict


def state_to_trees(opt_state: Any, params: Any) -> Any:
  """Optimizer state in the layout-independent form that checkpoints hold."""
  return dos_jax.state_to_pytrees(opt_state, params)


def state_from_trees(trees: Any, params: Any, tx: Any) -> Any:
  """The inverse of `state_to_trees` for optimizer `tx`: re-packs and places the state."""
  return dos_jax.state_from_pytrees(trees, params, tx)


def _abstract(tree: Any) -> Any:
  """Shape/dtype/sharding targets (memory kind included), so orbax restores each leaf
  straight into the run's sharding instead of onto one device."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


class Checkpointer:
  """Saves and restores a run's checkpoints in one directory, keeping the newest `keep`."""

  def __init__(self, directory: str, *, keep: int, async_save: bool):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        ),
        item_names=('params', 'opt_state', 'meta'),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, *, params: Any, opt_state: Any, meta: dict) -> None:
    """Starts saving (in the background when async); `wait()` blocks until it is on disk."""
    trees = state_to_trees(opt_state, params)
    self._manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(trees),
            meta=ocp.args.JsonSave(meta),
        ),
        force=True,
    )

  def restore(self, step: int, *, params: Any, opt_state: Any, tx: Any) -> Restored:
    """Restores checkpoint `step` into the layout of the given (freshly initialized)
    `params` and `opt_state`, whatever policy or subgroup size wrote it."""
    trees = state_to_trees(opt_state, params)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params)),
            opt_state=ocp.args.StandardRestore(_abstract(trees)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    new_params = restored['params']
    new_state = state_from_trees(restored['opt_state'], new_params, tx)
    return Restored(step=step, params=new_params, opt_state=new_state, meta=dict(restored['meta']))

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
