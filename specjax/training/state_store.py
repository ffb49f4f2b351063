"""Training-state checkpoints that a SIGKILL at any moment cannot spoil.

A `StateStore` is one orbax `CheckpointManager` directory of step
checkpoints (`<dir>/<step>/`), written synchronously, with three guarantees:

* Atomic saves. orbax (0.12) writes a step into
  `<dir>/<step>.orbax-checkpoint-tmp-<t>/`, writes `commit_success.txt` into
  it, and only then renames it to `<dir>/<step>/`. A kill before the rename
  leaves a temporary directory that no listing counts as a step and that
  opening the store deletes; a kill after it leaves a complete step.
* Atomic retirement. Old steps are first renamed into `<dir>/trash/` (one
  rename) and only then deleted, so a kill mid-delete cannot leave a
  half-deleted step that looks like a checkpoint; opening the store empties
  the trash. A kill after a save's commit but before its retirements leaves
  one step too many: opening the store (keep-best stores: `delete_after`)
  retires it.
* Checked restores. Only complete steps (both orbax's step metadata and the
  commit marker present) are restored, and the checkpoint's tree (leaf
  paths, shapes, dtypes) must match the caller's template exactly: a
  checkpoint of another model, optimizer or drafter is a `CheckpointError`
  that names the differing leaves, never a silent cast or reshape.

Fault injection (tests): with SPECJAX_FAULT_AT="<point>@<step>" in the
environment the process SIGKILLs itself when it reaches that point at that
step. Points: "<dir name>:before_commit" (the step's files are written to
the temporary directory, not yet marked committed or renamed),
"<dir name>:after_commit" (renamed; older steps not yet retired), and the
training loop's own ("step", after the update of that step, before anything
is written).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.path import atomicity

from specjax.io.checkpoints import CheckpointError

FAULT_ENV = "SPECJAX_FAULT_AT"
TRASH = "trash"
_TMP_MARK = ".orbax-checkpoint-tmp"
_COMMIT_FILE = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"


def fault_point(name: str, step: int) -> None:
  """SIGKILL this process if SPECJAX_FAULT_AT names this point and step."""
  if os.environ.get(FAULT_ENV) == f"{name}@{int(step)}":
    os.kill(os.getpid(), signal.SIGKILL)


class _RenameWithFaultPoints(atomicity.AtomicRenameTemporaryPath):
  """orbax's atomic-rename commit, with fault points either side of it."""

  async def finalize(self):
    final = self.get_final()
    # orbax commits each item inside a step ("<step>.tmp/default") the same way;
    # the points are about the step directory's own commit.
    step = int(final.name) if final.name.isdigit() else None
    if step is not None:
      fault_point(f"{final.parent.name}:before_commit", step)
    await super().finalize()
    if step is not None:
      fault_point(f"{final.parent.name}:after_commit", step)


def tree_digest(tree) -> np.ndarray:
  """sha256 over a pytree's leaf paths, shapes, dtypes and bytes -> uint8[32]."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    arr = np.ascontiguousarray(np.asarray(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{arr.shape}:{arr.dtype}|".encode())
    h.update(arr.tobytes())
  return np.frombuffer(h.digest(), np.uint8).copy()


class DamagedCheckpointError(CheckpointError):
  """A step directory whose files cannot be read back."""


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _signature(tree) -> Dict[Tuple[str, ...], Tuple[tuple, str]]:
  """{leaf path: (shape, dtype)}; paths spelled alike for dicts, lists,
  namedtuples and dataclasses, since orbax's metadata turns all into dicts/lists."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[tuple(_key_name(k) for k in path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
  return out


def check_like(where: str, saved, like) -> None:
  """CheckpointError unless `saved` (leaves with .shape/.dtype) has exactly the
  leaves of `like`, with the same shapes and dtypes."""
  a, b = _signature(saved), _signature(like)
  problems = [f"{'/'.join(p)} is missing" for p in b if p not in a]
  problems += [f"{'/'.join(p)} is not expected" for p in a if p not in b]
  problems += [f"{'/'.join(p)} is {a[p][1]}{list(a[p][0])}, expected {b[p][1]}{list(b[p][0])}"
               for p in b if p in a and a[p] != b[p]]
  if problems:
    more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
    raise CheckpointError(f"{where} does not hold this run's training state: "
                          + "; ".join(problems[:6]) + more +
                          ". It was written by another model, drafter or optimizer: use "
                          "another workdir")


class StateStore:
  """Step checkpoints in `directory` (see the module docstring)."""

  def __init__(self, directory: str, *, max_to_keep: Optional[int] = 2,
               best_metric: Optional[str] = None, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    if not read_only:
      os.makedirs(self.directory, exist_ok=True)
      self._clean()
    best = {} if best_metric is None else dict(
        best_fn=lambda m: m[best_metric], best_mode="max",
        keep_checkpoints_without_metrics=False)
    writable = dict(save_interval_steps=0) if read_only else dict(todelete_subdir=TRASH)
    self._max_to_keep = None if read_only else max_to_keep
    self._best_metric = best_metric
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self._max_to_keep, enable_async_checkpointing=False,
            read_only=read_only,
            create=False,  # made above (orbax refuses to with active_processes)
            temporary_path_class=_RenameWithFaultPoints,
            # In a multi-process job each process's store is its own: process
            # 0 writes (host copies of replicated state), the others only read.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index(), active_processes={jax.process_index()}),
            **best, **writable),
        # named up front, so a fresh manager can read a step's tree metadata
        item_handlers=ocp.StandardCheckpointHandler())
    if not read_only and best_metric is None:
      self._retain()  # a kill between a save and its retirements left one too many

  def _clean(self) -> None:
    """Delete what a killed save or delete left: temporary step directories
    and retired steps in the trash."""
    for name in os.listdir(self.directory):
      if _TMP_MARK in name or name == TRASH:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _retain(self) -> None:
    """Retire the steps that `max_to_keep` no longer keeps. orbax retires them
    after each save, so a kill between a save's commit and its retirements
    leaves one step too many; with no later save (a run killed after its last
    checkpoint), nothing else would. Keeps the newest steps, or with a
    `best_metric` the best ones (ties: the newest, as orbax does)."""
    if self._max_to_keep:
      steps = self.steps()  # complete ones: an incomplete step never displaces one
      if self._best_metric is None:
        ranked = sorted(steps, reverse=True)
      else:
        def rank(s):
          v = (self._mgr.metrics(s) or {}).get(self._best_metric)
          return (v is not None, float(v) if v is not None else 0.0, s)
        ranked = sorted(steps, key=rank, reverse=True)
      for s in ranked[self._max_to_keep:]:
        self._mgr.delete(s)
    self._clean()  # the retired steps' trash

  def _complete(self, step: int) -> bool:
    d = os.path.join(self.directory, str(step))
    return all(os.path.exists(os.path.join(d, f)) for f in (_COMMIT_FILE, _STEP_METADATA))

  def steps(self) -> List[int]:
    """The complete steps, oldest first."""
    return [s for s in self._mgr.all_steps() if self._complete(s)]

  def latest_step(self) -> Optional[int]:
    steps = self.steps()
    return steps[-1] if steps else None

  def best_step(self) -> Optional[int]:
    step = self._mgr.best_step()
    return step if step is not None and self._complete(step) else None

  def save(self, step: int, tree, metrics: Optional[Dict[str, float]] = None) -> None:
    self._mgr.save(step, args=ocp.args.StandardSave(tree), metrics=metrics, force=True)
    self._mgr.wait_until_finished()
    shutil.rmtree(os.path.join(self.directory, TRASH), ignore_errors=True)  # retired steps

  def restore(self, step: int, like=None):
    """The tree saved at `step`, checked against `like` (leaves with .shape and
    .dtype) when given; without `like`, whatever the checkpoint holds (numpy)."""
    where = os.path.join(self.directory, str(step))
    if not self._complete(step):
      raise DamagedCheckpointError(f"{where} is not a complete checkpoint")
    if like is None:
      try:
        return jax.tree.map(np.asarray,
                            self._mgr.restore(step, args=ocp.args.StandardRestore()))
      except Exception as e:  # orbax raises many types for damaged files
        raise DamagedCheckpointError(f"{where}: cannot restore ({type(e).__name__}: {e})") \
            from e
    try:
      saved = self._mgr.item_metadata(step)
      saved = getattr(saved, "tree", saved)
    except Exception as e:  # orbax raises many types for damaged metadata
      raise DamagedCheckpointError(f"{where}: unreadable checkpoint metadata "
                                   f"({type(e).__name__}: {e})") from e
    check_like(where, saved, like)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    try:
      return self._mgr.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # a damaged array file
      raise DamagedCheckpointError(f"{where}: cannot restore ({type(e).__name__}: {e})") from e

  def restore_latest(self, like, progress=None) -> Tuple[Optional[int], Any]:
    """(step, tree) of the newest complete step that restores, or (None, None)
    when there is none. A damaged step (unreadable files) is reported and the
    one before it tried; a step of another tree is an error (`check_like`)."""
    for step in reversed(self.steps()):
      try:
        return step, self.restore(step, like)
      except DamagedCheckpointError as e:
        if progress is not None:
          progress(f"skipping a damaged checkpoint: {e}")
    return None, None

  def delete_after(self, step: int) -> None:
    """Drop the steps newer than `step` (a resumed run recomputes them), then
    any that retention no longer keeps."""
    for s in self._mgr.all_steps():
      if s > step:
        self._mgr.delete(s)
    self._retain()

  def close(self) -> None:
    self._mgr.close()
