"""The shared training loop: optax, orbax checkpoints with exact resume and
keep-best, progress lines, a JSONL metrics log and a PNG of the curves.

Determinism: the batch of step s is a pure function of (seed, s), so a run
killed after step s and resumed from its checkpoint sees exactly the batches
an uninterrupted run would, and reaches the same parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, Optional

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp


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


def train(*, workdir: str, init_params: Any, optimizer, step_fn: Callable, batch_fn: Callable,
          num_steps: int, eval_fn: Optional[Callable] = None, eval_every: int = 100,
          save_every: int = 100, best_metric: str = "tau", log_every: int = 10,
          progress: Optional[Callable[[str], None]] = None,
          stop_after: Optional[int] = None) -> TrainResult:
  """Run (or resume) training in `workdir`.

  step_fn(params, opt_state, batch) -> (params, opt_state, metrics dict)  (jitted)
  batch_fn(step) -> batch                                                 (pure in step)
  eval_fn(params) -> metrics dict (host floats); `best_metric` among them
  is maximised by the keep-best manager (workdir/best).
  stop_after: stop (as if killed) after this many steps of this call -- tests.
  """
  progress = progress or (lambda s: print(s, flush=True))
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  state_mgr = ocp.CheckpointManager(
      os.path.join(workdir, "state"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1,
                                           enable_async_checkpointing=False))
  best_mgr = ocp.CheckpointManager(
      os.path.join(workdir, "best"),
      options=ocp.CheckpointManagerOptions(max_to_keep=1, best_fn=lambda m: m[best_metric],
                                           best_mode="max",
                                           keep_checkpoints_without_metrics=False,
                                           enable_async_checkpointing=False))
  params = init_params
  opt_state = optimizer.init(params)
  start = 0
  latest = state_mgr.latest_step()
  if latest is not None:
    abstract = {"params": params, "opt_state": opt_state}
    restored = state_mgr.restore(latest, args=ocp.args.StandardRestore(
        jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)))
    params, opt_state, start = restored["params"], restored["opt_state"], latest
    progress(f"resumed from step {start} in {workdir}")
  log_path = os.path.join(workdir, "metrics.jsonl")
  history = _read_jsonl(log_path)
  history = [h for h in history if h["step"] <= start]  # drop lines past the checkpoint
  _write_jsonl(log_path, history)
  best = max((h[best_metric] for h in history if best_metric in h), default=None)
  t0, tokens_seen, ran = time.perf_counter(), 0, 0
  acc = {}
  for step in range(start + 1, num_steps + 1):
    batch = batch_fn(step)
    params, opt_state, m = step_fn(params, opt_state, batch)
    ran += 1
    m = jax.device_get(m)
    tokens_seen += int(m.pop("positions", 0))
    for key, v in m.items():
      acc.setdefault(key, []).append(float(np.mean(v)))
    row = None
    if step % log_every == 0 or step == num_steps:
      el = time.perf_counter() - t0
      row = {"step": step, **{key: float(np.mean(v)) for key, v in acc.items()},
             "positions_per_s": tokens_seen / max(el, 1e-9), "elapsed_s": el}
      acc = {}
      eta = el / ran * (num_steps - step)
      progress(f"step {step}/{num_steps} " + " ".join(
          f"{key}={row[key]:.4g}" for key in row if key not in ("step", "elapsed_s")) +
          f" ETA {eta:.0f}s")
    if eval_fn is not None and (step % eval_every == 0 or step == num_steps):
      ev = eval_fn(params)
      row = {**(row or {"step": step}), **ev}
      progress(f"eval step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in ev.items()))
      best_mgr.save(step, args=ocp.args.StandardSave(params), metrics={k: float(v) for k, v
                                                                         in ev.items()})
      best_mgr.wait_until_finished()
      best = ev[best_metric] if best is None else max(best, ev[best_metric])
    if row is not None:
      history.append(row)
      with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if step % save_every == 0 or step == num_steps:
      state_mgr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
      state_mgr.wait_until_finished()
    if stop_after is not None and ran >= stop_after:
      break
  final_step = start + ran
  if history:
    plot_curves(history, os.path.join(workdir, "curves.png"))
  return TrainResult(params=params, step=final_step, best_metric=best, history=history)


def latest_params(workdir: str):
  """(params, step) of the newest training-state checkpoint in workdir."""
  mgr = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "state"),
                              options=ocp.CheckpointManagerOptions(read_only=True))
  step = mgr.latest_step()
  if step is None:
    return None, None
  meta = mgr.restore(step, args=ocp.args.StandardRestore())
  return jax.tree.map(np.asarray, meta["params"]), step


def best_params(workdir: str, like):
  mgr = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "best"),
                              options=ocp.CheckpointManagerOptions(
                                  best_fn=lambda m: 0.0, read_only=True))
  step = mgr.best_step()
  if step is None:
    return None, None
  return mgr.restore(step, args=ocp.args.StandardRestore(
      jax.tree.map(ocp.utils.to_shape_dtype_struct, like))), step


def _read_jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


def _write_jsonl(path, rows):
  with open(path + ".tmp", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  os.replace(path + ".tmp", path)


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
