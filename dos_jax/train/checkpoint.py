"""Orbax checkpoints of a run: params, optimizer state, step, data position.

The optimizer state is saved as layout-independent pytrees shaped like the params
(`dos_jax.state_to_pytrees`: master weights, moments, count), not as the packed
subgroups, so a run can resume under another placement policy or subgroup size;
`dos_jax.state_from_pytrees` re-packs them and places them in `pinned_host` memory.
(Both go through device memory today, in the core: fine on CPU and for models whose
state fits the device; for 7B+ on a GPU they need a host-side unpack/pack.)

Orbax writes each checkpoint into a temporary directory and renames it when complete,
so a process killed mid-save leaves no checkpoint that looks finished; leftover
temporary directories are removed (and listed in `Checkpointer.discarded`) when the
directory is next opened. A save that fails (a full disk, a read-only folder) removes
its temporary directory at once and raises `SaveFailed`. On top of
that each checkpoint gets a checksum manifest (`integrity`): restore verifies it and a
damaged newest checkpoint falls back to the previous complete one; non-finite params
are never saved.

A state with a disk tier does not fit in memory to be unpacked: it is saved as one file
per subgroup (`dos_jax.state_to_files`, the disk tier's files hard-linked) in the
checkpoint's `subgroups/` folder, staged beside the checkpoints while orbax writes
(`.subgroups-<step>`, each process writing its own devices' files) and moved in before
the manifest, which covers its files too. It restores into a run with the same
subgroups, whatever its split between disk and memory.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import dos_jax
from dos_jax.planner import memory
from dos_jax.train import integrity


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `Checkpointer.restore` returns."""

  step: int
  params: Any
  opt_state: Any
  meta: dict


def state_to_trees(opt_state: Any, params: Any) -> Any:
  """Optimizer state in the layout-independent form that checkpoints hold."""
  to_trees = getattr(opt_state, 'to_trees', None)  # A pipelined run's per-stage state.
  if to_trees is not None:
    return to_trees()
  return dos_jax.state_to_pytrees(opt_state, params)


def state_from_trees(trees: Any, params: Any, tx: Any) -> Any:
  """The inverse of `state_to_trees` for optimizer `tx`: re-packs and places the state."""
  from_trees = getattr(tx, 'state_from_trees', None)  # A pipelined run's stage optimizers.
  if from_trees is not None:
    return from_trees(trees, params)
  return dos_jax.state_from_pytrees(trees, params, tx)


def _abstract(tree: Any) -> Any:
  """Shape/dtype/sharding targets (memory kind included), so orbax restores each leaf
  straight into the run's sharding instead of onto one device."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


class NonFiniteState(ValueError):
  """The params about to be saved hold NaN or Inf; nothing was written."""


TMP_MARK = '.orbax-checkpoint-tmp'
SUBGROUPS = 'subgroups'  # a checkpoint's folder of subgroup files (a disk tier's state)
_STAGING = '.subgroups-'  # + step: those files while orbax writes the checkpoint


class SaveFailed(Exception):
  """Writing checkpoint `step` into `directory` failed (`__cause__` says why: orbax's or
  the OS's error); its temporary files were removed (`removed`). `needed_bytes` is
  the size of one checkpoint of this run (its arrays), for a message about space."""

  def __init__(self, step: int, directory: str, needed_bytes: int, removed: list[str]):
    super().__init__(f'checkpoint {step} could not be written to {directory}')
    self.step = step
    self.directory = directory
    self.needed_bytes = needed_bytes
    self.removed = removed


def _temporaries(directory: str, *, staged: bool = True) -> list[str]:
  """Names of the unfinished checkpoints in `directory`: orbax's temporary directories,
  and (`staged`) the subgroup files staged for one."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(n for n in names if TMP_MARK in n or (staged and n.startswith(_STAGING)))


def _tree_bytes(*trees: Any) -> int:
  return sum(int(getattr(x, 'nbytes', 0)) for x in jax.tree.leaves(trees))


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  # The largest magnitude of each leaf (a NaN propagates through max): a reduction
  # with no temporary, where `all(isfinite(x))` holds a bool per parameter (2 GB at 2B).
  leaves = [jnp.isfinite(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def all_finite(tree: Any) -> bool:
  """Whether every float leaf of `tree` is finite (one small program, one scalar back)."""
  return bool(_all_finite(tree))


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A checkpoint that `find_restorable` passed over, and why."""

  step: int
  reason: str


def step_dirs(directory: str) -> list[int]:
  """Integer-named subdirectories: orbax's finished checkpoints (temporaries excluded)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def has_checkpoint(directory: str) -> bool:
  """Whether `directory` holds any finished checkpoint, complete or not (reads a listing)."""
  return bool(step_dirs(directory))


def find_restorable(directory: str) -> tuple[int | None, dict | None, list[Skipped]]:
  """The newest checkpoint in `directory` whose files match their checksums, its
  manifest, and the newer ones passed over (incomplete or corrupt). Reads only, so the
  loop can check a resume before it writes anything.

  When no checkpoint has a manifest at all (a directory written before checksums
  existed), the newest one is returned with manifest None: restored unverified rather
  than silently starting the run again.
  """
  skipped = []
  steps = step_dirs(directory)
  for step in reversed(steps):
    try:
      return step, integrity.verify(os.path.join(directory, str(step))), skipped
    except integrity.CheckpointDamaged as err:
      skipped.append(Skipped(step, str(err)))
  if steps and not any(integrity.has_manifest(os.path.join(directory, str(s))) for s in steps):
    return steps[-1], None, []
  return None, None, skipped


def linked_back_bytes(directory: str, disk_dir: str) -> float:
  """Bytes of the disk tier's state in the newest checkpoint in `directory` (its
  `subgroups/` files), which a resume links into `disk_dir` instead of writing: 0 when
  it has none or is on another filesystem (then copied)."""
  steps = step_dirs(directory)
  if not steps:
    return 0.0
  folder = os.path.join(directory, str(steps[-1]), SUBGROUPS)
  try:
    if os.stat(folder).st_dev != os.stat(memory.existing_parent(disk_dir)).st_dev:
      return 0.0
  except OSError:
    return 0.0
  return float(sum(os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(folder) for name in names
                   if name.startswith('sg')))


class Checkpointer:
  """Saves and restores a run's checkpoints in one directory, keeping the newest `keep`.

  Every save gets a checksum manifest (`integrity`) once orbax has finished writing it
  (hashed in a background thread after an async save; `wait` joins it); only then does
  rotation delete older checkpoints, and it counts only checkpoints that
  have a manifest, so the newest complete checkpoint is never deleted in favour of one
  that may not finish. Params that are not finite are refused before anything is
  written (`NonFiniteState`), so a diverged run cannot replace good checkpoints.
  In a multi-process run only process 0 writes manifests and deletes.
  """

  def __init__(self, directory: str, *, keep: int, async_save: bool):
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._async = async_save
    self._pending: list[tuple[int, dict | None]] = []
    self._finisher: threading.Thread | None = None
    self._error: BaseException | None = None
    self._lead = jax.process_index() == 0
    self._bytes = 0  # One checkpoint's arrays, known at the first save.
    self._saving: int | None = None  # The step of the newest save started.
    # A save failed (its error): orbax's manager only re-raises it from now on.
    self._broken: SaveFailed | None = None
    # A save a killed process left unfinished: gone before the manager opens (which
    # would remove it silently), so the run can say so.
    self.discarded: list[str] = _temporaries(self.directory, staged=False)
    if self._lead:  # (the subgroup files staged for such a save go too, unsaid)
      for name in _temporaries(self.directory):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None,  # Rotation is ours: after the manifest, complete ones only.
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        ),
        item_names=('params', 'opt_state', 'meta'),
    )

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    """The newest checkpoint that has a manifest (not verified: see `find_restorable`)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints (those with a manifest), oldest first."""
    return [s for s in sorted(self._manager.all_steps())
            if integrity.has_manifest(self.step_dir(s))]

  def save(self, step: int, *, params: Any, opt_state: Any, meta: dict,
           run: dict | None = None) -> None:
    """Starts saving (in the background when async); `wait()` blocks until it is on disk
    with its manifest. `run` (JSON) is stored in the manifest for the resume check.

    Raises:
      NonFiniteState: a param is NaN or Inf (nothing is written).
    """
    if not all_finite(params):
      raise NonFiniteState(f'step {step}: the parameters are not finite; not saved')
    self.wait()
    if self._broken:
      raise RuntimeError('a checkpoint save failed before: this Checkpointer takes no more')
    self._saving = step
    self._pending.append((step, run))
    try:
      self._probe()
      trees = self._state_form(step, opt_state, params)
      self._bytes = _tree_bytes(params, trees)
      self._manager.save(
          step,
          args=ocp.args.Composite(
              params=ocp.args.StandardSave(params),
              opt_state=ocp.args.StandardSave(trees),
              meta=ocp.args.JsonSave(meta),
          ),
          force=True,
      )
    except Exception as err:  # pylint: disable=broad-exception-caught
      raise self._failed() from err
    if not self._async:
      self.wait()
    else:  # Hash in the background too: training goes on while it reads the files.
      self._finisher = threading.Thread(target=self._finish, name='checkpoint-manifest')
      self._finisher.start()

  def _state_form(self, step: int, opt_state: Any, params: Any) -> Any:
    """The tree orbax saves for `opt_state`; a disk tier's state goes to files first
    (staged now, between steps, while the disk tier's files are this step's)."""
    if getattr(opt_state, 'to_trees', None) is not None or not dos_jax.has_disk_tier(opt_state):
      return state_to_trees(opt_state, params)
    staging = os.path.join(self.directory, f'{_STAGING}{step}')
    if self._lead:  # every process writes its own devices' files into it: process 0 makes it
      shutil.rmtree(staging, ignore_errors=True)
      os.makedirs(self.directory, exist_ok=True)
    return dos_jax.state_to_files(opt_state, staging)

  def find_restorable(self) -> tuple[int | None, dict | None, list[Skipped]]:
    return find_restorable(self.directory)

  def quarantine(self, skipped: list[Skipped]) -> list[str]:
    """Moves damaged checkpoints aside (`<step>.damaged`, kept for inspection) so the
    resumed run can save those steps again; returns the new paths."""
    moved = []
    for item in skipped:
      target = f'{self.step_dir(item.step)}.damaged'
      n = 1
      while os.path.exists(target):
        n += 1
        target = f'{self.step_dir(item.step)}.damaged{n}'
      if self._lead:
        os.replace(self.step_dir(item.step), target)
      moved.append(target)
    if moved:
      self._manager.reload()
    return moved

  def restore(self, step: int, *, params: Any, opt_state: Any, tx: Any) -> Restored:
    """Restores checkpoint `step` into the layout of the given (freshly initialized)
    `params` (arrays, or their `jax.ShapeDtypeStruct`s with shardings) and `opt_state`,
    whatever policy or subgroup size wrote it."""
    files = os.path.join(self.step_dir(step), SUBGROUPS)
    if os.path.isdir(files):
      trees = dos_jax.state_files_tree(opt_state)
    elif getattr(opt_state, 'to_trees', None) is not None:
      trees = state_to_trees(opt_state, params)
    else:  # a disk tier's files are not read: the run being restored wrote none
      trees = dos_jax.pytree_targets(opt_state, params)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params)),
            opt_state=ocp.args.StandardRestore(_abstract(trees)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    new_params = restored['params']
    if os.path.isdir(files):
      new_state = dos_jax.state_from_files(restored['opt_state'], files, opt_state)
    else:
      new_state = state_from_trees(restored['opt_state'], new_params, tx)
    return Restored(step=step, params=new_params, opt_state=new_state, meta=dict(restored['meta']))

  def wait(self) -> None:
    """Blocks until pending saves are on disk with their manifests, and rotated.

    Raises:
      SaveFailed: a save failed (raised once; the checkpointer takes no more saves).
    """
    finisher, self._finisher = self._finisher, None
    if finisher is not None:
      finisher.join()
      error, self._error = self._error, None
      if error is not None:
        raise error
    if not self._broken:
      self._finish()

  def _finish(self) -> None:
    """Waits for orbax, writes the pending manifests, rotates (in the finisher thread
    after an async save; the main thread touches the manager only after joining it)."""
    try:
      try:
        self._manager.wait_until_finished()
        self._write_manifests()
      except Exception as err:  # pylint: disable=broad-exception-caught
        raise self._failed() from err
    except BaseException as err:  # pylint: disable=broad-exception-caught
      if threading.current_thread() is threading.main_thread():
        raise
      self._error = err

  def _probe(self) -> None:
    """Makes and removes a directory where orbax is about to make one. A folder that
    is read-only, not writable or out of space fails here, as an OSError naming it:
    orbax, when it cannot make its directory, leaves threads waiting minutes for it."""
    probe = os.path.join(self.directory, f'.write-probe-{jax.process_index()}')
    if os.path.isdir(probe):  # Left by a process killed between the two calls.
      os.rmdir(probe)
    os.mkdir(probe)
    os.rmdir(probe)

  def _failed(self) -> SaveFailed:
    """Removes what the failed save left (orbax's temporary directories, and a
    finished directory of a pending step that got no manifest); the error to raise."""
    steps = [step for step, _ in self._pending] or [self._saving]
    self._pending.clear()
    self._broken = SaveFailed(steps[-1], self.directory, self._bytes, [])
    self._remove_debris()
    try:
      self._manager.reload()
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # A directory that cannot even be listed: the error raised says why.
    return self._broken

  def _remove_debris(self) -> None:
    """Removes the failed save's temporary directories (and its directory if orbax
    renamed it but it has no manifest), recording them in the SaveFailed."""
    failed = self._broken
    if not self._lead or not failed:
      return
    doomed = _temporaries(self.directory)
    if os.path.isdir(self.step_dir(failed.step)) and not integrity.has_manifest(
        self.step_dir(failed.step)):
      doomed.append(str(failed.step))
    for name in doomed:
      shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      if not os.path.exists(os.path.join(self.directory, name)) and name not in failed.removed:
        failed.removed.append(name)

  def _write_manifests(self) -> None:
    if not self._pending:
      return
    if self._lead:
      for step, run in self._pending:
        if os.path.isdir(self.step_dir(step)):
          staging = os.path.join(self.directory, f'{_STAGING}{step}')
          if os.path.isdir(staging):
            os.replace(staging, os.path.join(self.step_dir(step), SUBGROUPS))
          integrity.write_manifest(self.step_dir(step), step=step, run=run)
    self._pending.clear()
    self._rotate()

  def _rotate(self) -> None:
    """Deletes all but the newest `keep` complete checkpoints, and incomplete ones older
    than the newest complete one (never one newer: it may still be being written)."""
    if not self._lead:
      return
    complete = self.all_steps()
    if not complete:
      return
    doomed = complete[:-self._keep]
    doomed += [s for s in self._manager.all_steps()
               if s < complete[-1] and s not in complete]
    for step in sorted(set(doomed)):
      self._manager.delete(step)

  def close(self) -> None:
    self.wait()
    if self._broken:
      try:  # Its failed save is reported already; orbax would only raise it again.
        self._manager.close()
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      # Writes of the failed save that were still in flight when it failed may have
      # made directories again after `_failed` removed them: clean until it stays clean.
      clean = 0
      for _ in range(50):
        self._remove_debris()
        clean = clean + 1 if not _temporaries(self.directory) else 0
        if clean >= 3:
          break
        time.sleep(0.1)
      return
    self._manager.close()
