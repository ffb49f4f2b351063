"""The shared training loop: optax, orbax checkpoints with exact resume and
keep-best, progress lines, a JSONL metrics log and a PNG of the curves.

Determinism: the batch of step s is a pure function of (seed, s), so a run
killed after step s and resumed from its checkpoint sees exactly the batches
an uninterrupted run would, and reaches the same parameters bit for bit
(tests/test_fault_tolerance.py kills runs with SIGKILL to check it).

The training-state checkpoint (workdir/state, `state_store.StateStore`) holds
the parameters, the optimizer state, the step, the run's PRNG key and the data
position: the step of the next batch and a digest of that batch. A resume
checks all of them against the run it continues, so a workdir resumed with
another seed, data set or batch size is an error instead of a silent hybrid.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, Optional

import jax
import numpy as np
import optax

from specjax import distributed
from specjax.io import jsonl
from specjax.io.checkpoints import CheckpointError
from specjax.training.state_store import StateStore, fault_point, tree_digest


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                             end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched,
                                                                  weight_decay=weight_decay))


@dataclasses.dataclass
class TrainResult:
  params: Any
  step: int
  best_metric: Optional[float]
  history: list
  early_stopped: bool = False  # `patience` evaluations without a new best


def train(*, workdir: str, init_params: Any, optimizer, step_fn: Callable, batch_fn: Callable,
          num_steps: int, eval_fn: Optional[Callable] = None, eval_every: int = 100,
          save_every: int = 100, best_metric: str = "tau", log_every: int = 10,
          progress: Optional[Callable[[str], None]] = None,
          stop_after: Optional[int] = None, key: Optional[jax.Array] = None,
          patience: int = 0) -> TrainResult:
  """Run (or resume) training in `workdir`.

  step_fn(params, opt_state, batch) -> (params, opt_state, metrics dict)  (jitted)
  batch_fn(step) -> batch                                                 (pure in step)
  eval_fn(params) -> metrics dict (host floats); `best_metric` among them
  is maximised by the keep-best manager (workdir/best).
  stop_after: stop (as if killed) after this many steps of this call -- tests.
  key: the run's PRNG key (the one batch_fn derives its per-step keys from),
  stored in the checkpoint so that a resume with another key is refused.
  patience: > 0 stops early once that many evaluations in a row brought no
  new best `best_metric` (the state is saved there; a resumed run that had
  stopped stays stopped).
  """
  # In a multi-process job (step_fn from distributed.data_parallel_step) every
  # process runs this loop in lockstep; process 0 alone writes checkpoints,
  # metrics and curves (host copies of the replicated state), the others
  # restore from its checkpoints.
  primary = distributed.is_primary()
  progress = progress or (lambda s: print(s, flush=True))
  if not primary:
    progress = lambda s: None  # pylint: disable=unnecessary-lambda-assignment
  host = distributed.to_host if distributed.multi_process() else (lambda t: t)
  workdir = os.path.abspath(workdir)
  if primary:
    os.makedirs(workdir, exist_ok=True)
    state_store = StateStore(os.path.join(workdir, "state"), max_to_keep=2)
    best_store = StateStore(os.path.join(workdir, "best"), max_to_keep=1,
                            best_metric=best_metric)
  distributed.barrier("train/open")  # process 0 has cleaned up what a kill left
  if not primary:
    state_store = StateStore(os.path.join(workdir, "state"), read_only=True)
  key_data = _key_data(key)
  params = init_params
  opt_state = optimizer.init(params)
  template = _train_state(params, opt_state, 0, key_data, batch_fn)
  start, restored = state_store.restore_latest(template, progress)
  if start is None:
    start = 0
  else:
    _check_resume(state_store.directory, start, restored, key_data, batch_fn)
    params, opt_state = restored["params"], restored["opt_state"]
    progress(f"resumed from step {start} in {workdir}")
  if not primary:
    state_store.close()
  log_path = os.path.join(workdir, "metrics.jsonl")
  history = jsonl.read(log_path)
  history = [h for h in history if h["step"] <= start]  # drop lines past the checkpoint
  distributed.barrier("train/restored")  # everyone read the state before it changes
  if primary:
    best_store.delete_after(start)  # keep-best saves past the checkpoint are redone
    jsonl.write(log_path, history)
  best = max((h[best_metric] for h in history if best_metric in h), default=None)
  t0, tokens_seen, ran = time.perf_counter(), 0, 0
  acc = {}
  stopped = _no_improvement(history, best_metric, patience)
  if stopped:
    progress(f"early-stopped before step {start}: {patience} evaluations without a new best")
  for step in range(start + 1, num_steps + 1):
    if stopped:
      break
    batch = batch_fn(step)
    params, opt_state, m = step_fn(params, opt_state, batch)
    ran += 1
    fault_point("step", step)
    m = jax.device_get(host(m))
    tokens_seen += int(m.pop("positions", 0))
    for name, v in m.items():
      acc.setdefault(name, []).append(float(np.mean(v)))
    row = None
    if step % log_every == 0 or step == num_steps:
      el = time.perf_counter() - t0
      row = {"step": step, **{name: float(np.mean(v)) for name, v in acc.items()},
             "positions_per_s": tokens_seen / max(el, 1e-9), "elapsed_s": el}
      acc = {}
      eta = el / ran * (num_steps - step)
      progress(f"step {step}/{num_steps} " + " ".join(
          f"{name}={row[name]:.4g}" for name in row if name not in ("step", "elapsed_s")) +
          f" ETA {eta:.0f}s")
    if eval_fn is not None and (step % eval_every == 0 or step == num_steps):
      ev = eval_fn(host(params))  # every process: the same host copy, the same figures
      row = {**(row or {"step": step}), **ev}
      progress(f"eval step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in ev.items()))
      if primary:
        best_store.save(step, host(params), metrics={k: float(v) for k, v in ev.items()})
      best = ev[best_metric] if best is None else max(best, ev[best_metric])
    if row is not None:
      history.append(row)
      if primary:
        jsonl.append(log_path, [row])
    stopped = _no_improvement(history, best_metric, patience)
    if stopped:
      progress(f"early stop at step {step}: {patience} evaluations without a new best "
               f"{best_metric} (best {best:.4g})")
    if primary and (step % save_every == 0 or step == num_steps or stopped):
      state_store.save(step, _train_state(host(params), host(opt_state), step, key_data,
                                          batch_fn))
    if stop_after is not None and ran >= stop_after:
      break
  if primary:
    state_store.close()
    best_store.close()
  distributed.barrier("train/done")  # the others may now read process 0's best/
  final_step = start + ran
  if history and primary:
    plot_curves(history, os.path.join(workdir, "curves.png"))
  return TrainResult(params=host(params), step=final_step, best_metric=best, history=history,
                     early_stopped=stopped)


def _no_improvement(history, metric: str, patience: int) -> bool:
  """Whether the last `patience` evaluations in `history` brought no new best."""
  if patience <= 0:
    return False
  evals = [h[metric] for h in history if metric in h]
  if not evals:
    return False
  best_at = int(np.argmax(evals))  # the first best
  return len(evals) - 1 - best_at >= patience


def _key_data(key) -> np.ndarray:
  key = jax.random.key(0) if key is None else key
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32)


def _train_state(params, opt_state, step: int, key_data, batch_fn) -> Dict[str, Any]:
  """Everything a resume needs: the update's inputs, and the data position
  (the step of the next batch, and a digest of that batch, which holds any
  key or data-set choice behind it)."""
  return {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int32),
          "key": key_data,
          "data": {"next_step": np.asarray(step + 1, np.int32),
                   "next_batch_sha256": tree_digest(batch_fn(step + 1))}}


def _check_resume(where: str, step: int, restored, key_data, batch_fn) -> None:
  """The restored state continues this run: its step, key and data position."""
  if int(restored["step"]) != step or int(restored["data"]["next_step"]) != step + 1:
    raise CheckpointError(f"{where}/{step} holds step {int(restored['step'])} (next batch "
                          f"{int(restored['data']['next_step'])}): a damaged checkpoint")
  if not np.array_equal(np.asarray(restored["key"]), key_data):
    raise CheckpointError(f"{where}/{step} was trained with PRNG key "
                          f"{np.asarray(restored['key']).tolist()}, this run's is "
                          f"{key_data.tolist()} (another seed?): use another workdir")
  if not np.array_equal(np.asarray(restored["data"]["next_batch_sha256"]),
                        tree_digest(batch_fn(step + 1))):
    raise CheckpointError(f"{where}/{step}: this run's batch {step + 1} is not the one the "
                          "checkpointed run would train on next (another seed, data set or "
                          "batch shape?): resuming would not reproduce either run; use "
                          "another workdir")


def latest_params(workdir: str):
  """(params, step) of the newest complete training-state checkpoint in workdir."""
  store = StateStore(os.path.join(os.path.abspath(workdir), "state"), read_only=True)
  try:
    step = store.latest_step()
    return (None, None) if step is None else (store.restore(step)["params"], step)
  finally:
    store.close()


def best_params(workdir: str, like, metric: str = "tau"):
  """(params, step) of the keep-best checkpoint in workdir (by `metric`),
  checked against `like`."""
  store = StateStore(os.path.join(os.path.abspath(workdir), "best"), max_to_keep=1,
                     best_metric=metric, read_only=True)
  try:
    step = store.best_step()
    return (None, None) if step is None else (store.restore(step, like), step)
  finally:
    store.close()


def plot_curves(history, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  keys = [k for k in history[-1] if k not in ("step", "elapsed_s", "positions_per_s")]
  if not keys:
    return
  fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3), squeeze=False)
  for ax, k in zip(axes[0], keys):
    pts = [(h["step"], h[k]) for h in history if k in h]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
    ax.set_title(k, fontsize=9)
    ax.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
