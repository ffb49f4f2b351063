"""A data-scaling curve for a trained drafter (EAGLE-3 by default): the same
recipe trained on nested subsets of the self-distilled data (0.1M, 0.3M, 1M
answer positions, ...), each to its early stop, then measured.

Per point (size, seed): the teacher-forced estimate of a k-chain on the fixed
validation set (tau and the per-depth greedy acceptance top1_0..top1_{k-1}),
the same estimate on training sequences (overfitting shows as the gap), and
Spec-Bench greedy decoding with the exported head (measured tau per category
beside the estimate). A log-linear fit tau = a + b ln(positions) of the
measured overall tau says what more data would buy.

Resumable: each point trains in its own workdir, benchmarks into its own
directory, and is appended to `out`/points.jsonl when done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Dict, List, Optional

import numpy as np

from specjax.benchmarks import questions, specbench
from specjax.checks import require_real, require_whole, require_whole_list
from specjax.drafters import registry
from specjax.io import jsonl
from specjax.settings import RunSettings, require
from specjax.training import distill_data, run as train_run
from specjax.training.settings import TrainSettings


@dataclasses.dataclass(frozen=True)
class ScalingSettings(RunSettings):
  """A data-scaling run (`experiments/scaling.py`, configs/scaling.py)."""

  data_path: str = ""  # the self-distillation JSONL (experiments/distill.py)
  sizes: str = "100000,300000,1000000"  # training answer positions per point
  seeds: int = 2  # seeds per point below `seeds_below` positions (one above)
  seeds_below: int = 300_000
  valid_sequences: int = 200  # one held-out set for every point, stratified by source
  train_eval_sequences: int = 200  # training sequences the train-set estimate reads
  epochs: float = 20.0  # an upper bound: each point stops early
  # evaluations (eval_every steps each) without a new best before a point stops:
  # the validation estimate moves by +-0.04 between evaluations while the
  # learning rate is high (the 278k point stopped at step 1,100 of 6,352 with
  # 3), so 10; no point below 0.3M ever stopped early, with either
  patience: int = 10
  eval_every: int = 100
  eval_k: int = 4
  # Spec-Bench with the exported head: a greedy k-chain
  bench_k: int = 4
  bench_prompt_limit: int = 10
  bench_max_new_tokens: int = 96
  bench_prompts: str = questions.SPEC_BENCH  # any JSONL file in Spec-Bench's format
  out: str = "/tmp/specjax_scaling"


def sizes(c: ScalingSettings) -> List[int]:
  """The comma-separated `sizes`, each a whole number of positions >= 1."""
  return require_whole_list("sizes", c.sizes,
                            why="training answer positions, e.g. '100000,300000'")


def check(c: ScalingSettings) -> None:
  """ConfigValueError naming the first setting of `c` out of its range."""
  sizes(c)
  for name, low in (("seeds", 1), ("seeds_below", 0), ("train_eval_sequences", 0),
                    ("eval_every", 1), ("eval_k", 1), ("bench_k", 1), ("bench_prompt_limit", 0),
                    ("bench_max_new_tokens", 1)):
    require_whole(name, getattr(c, name), low)
  require_whole("valid_sequences", c.valid_sequences, 1,
                "every point is measured on one stratified held-out set")
  require_whole("patience", c.patience, 1, "every point trains to its early stop")
  require_real("epochs", c.epochs, 0.0, low_open=True,
               why="an upper bound: each point stops early")


def points(c: ScalingSettings, available: int) -> List[Dict[str, int]]:
  """The (positions, seed) points the data can hold (sizes above `available`
  training answer tokens are left out)."""
  out = []
  for size in sizes(c):
    if size > available:
      continue
    for seed in range(c.seeds if size < c.seeds_below else 1):
      out.append({"positions": size, "seed": seed})
  return out


def trained_positions(row: dict) -> int:
  """The answer positions a point trained on: `train_positions` where its row
  records it (a size above what the data holds trains on all of it: the
  requested 300,000 took 278,665), else the requested size (rows logged
  before it was recorded)."""
  return row.get("train_positions") or row["positions"]


def fit(rows: List[dict], key: str = "bench_tau") -> Optional[Dict[str, float]]:
  """Least-squares tau = a + b ln(positions trained on) over the rows (None
  below two sizes)."""
  xs = np.asarray([math.log(trained_positions(r)) for r in rows], np.float64)
  ys = np.asarray([r[key] for r in rows], np.float64)
  if len(set(xs.tolist())) < 2:
    return None
  b, a = np.polyfit(xs, ys, 1)
  return {"a": float(a), "b": float(b), "per_doubling": float(b * math.log(2))}


def _point_settings(c: ScalingSettings, train: TrainSettings, p: Dict[str, int],
                    ids_path: str) -> TrainSettings:
  """The training run of point `p` (positions, seed): the recipe `train` with
  its data, cadence and output fields set by `c`."""
  name = f"{p['positions']}_s{p['seed']}"
  return dataclasses.replace(
      train, data_path=c.data_path, num_examples=0, valid_ids_path=ids_path,
      train_positions=p["positions"], seed=p["seed"], epochs=c.epochs, patience=c.patience,
      eval_every=c.eval_every, save_every=c.eval_every, eval_k=c.eval_k,
      valid_max_windows=c.valid_sequences, train_eval_sequences=c.train_eval_sequences,
      workdir=os.path.join(c.out, name), export=os.path.join(c.out, name, "export"))


def run_scaling(c: ScalingSettings, train: TrainSettings,
                progress: Optional[Callable[[str], None]] = None) -> dict:
  """Train and measure every point of `c`, with the recipe `train` (a
  TrainSettings; its data fields are set per point)."""
  require(c, ScalingSettings, "scaling.run_scaling")
  require(train, TrainSettings, "scaling.run_scaling")
  check(c)
  # the recipe as every point runs it, checked before the data is read
  _point_settings(c, train, {"positions": sizes(c)[0], "seed": 0}, "").check()
  progress = progress or (lambda s: print(s, flush=True))

  def bench_method(export: str) -> str:
    return f"{train.method}@k={c.bench_k}@checkpoint={export}"

  registry.parse_method(bench_method(""))  # a drafter without a checkpoint fails before training
  if not c.data_path or not os.path.isfile(c.data_path):
    raise FileNotFoundError(f"data_path={c.data_path!r}: no self-distillation data there "
                            "(experiments/distill.py writes it)")
  # the benchmark's prompts are read now, not after hours of training
  questions.load_questions(c.bench_prompts, c.bench_prompt_limit)
  records = distill_data.read_records(c.data_path)
  os.makedirs(c.out, exist_ok=True)
  # The held-out set is chosen once and kept: a repeated run on grown data
  # adds points, every one measured on the same validation records.
  ids_path = os.path.join(c.out, "valid_ids.json")
  if os.path.exists(ids_path):
    with open(ids_path) as f:
      valid_ids = json.load(f)
  else:
    valid_ids = [r["id"] for r in distill_data.select(
        records, valid_sequences=c.valid_sequences)[1]]
    with open(ids_path + ".tmp", "w") as f:
      json.dump(valid_ids, f)
    os.replace(ids_path + ".tmp", ids_path)
  train_recs, _ = distill_data.select(records, valid_ids=valid_ids)
  available = sum(len(r["answer"]) for r in train_recs)
  todo = points(c, available)
  progress(f"scaling: {available} training answer tokens in {c.data_path}; points "
           f"{[(p['positions'], p['seed']) for p in todo]}")
  log = os.path.join(c.out, "points.jsonl")
  done = {(r["positions"], r["seed"]) for r in jsonl.read(log)} if os.path.exists(log) else set()
  for p in todo:
    if (p["positions"], p["seed"]) in done:
      continue
    name = f"{p['positions']}_s{p['seed']}"
    ts = _point_settings(c, train, p, ids_path)
    out = train_run.run(ts, progress=progress)
    bench = specbench.run_benchmark(specbench.BenchmarkSettings(
        model=train.model, dtype=train.dtype, repeats=1, calibrate=False,
        methods=bench_method(ts.export), prompts=c.bench_prompts,
        prompt_limit=c.bench_prompt_limit, max_new_tokens=c.bench_max_new_tokens,
        out=os.path.join(c.out, name, "bench")), progress=progress)
    rows = [r for r in bench["results"] if r["method"] != "ar"]
    est = out["estimate"]
    row = {"positions": p["positions"], "seed": p["seed"], "steps": out["step"],
           "best_step": out["best_step"], "early_stopped": out["early_stopped"],
           # the answer positions trained on (the prefix, + any reference answers)
           "train_positions": out["train_positions"],
           "valid_tau": est["tau"], "valid_tau_rounds": est.get("tau_rounds"),
           "train_tau": out["train_estimate"]["tau"],
           **{f"top1_{s}": est[f"top1_{s}"] for s in range(c.eval_k)},
           "bench": {r["category"]: {"tau": r["tau"], "alpha": r["alpha"]} for r in rows}}
    row["bench_tau"] = row["bench"].get(specbench.ALL, {}).get("tau")
    jsonl.append(log, [row])
    progress(f"scaling point {name}: valid tau {row['valid_tau']:.3f}, Spec-Bench tau "
             f"{row['bench_tau']}")
  return report(c)


def report(c: ScalingSettings) -> dict:
  """`out`/scaling.md (table + fit) and scaling.png from points.jsonl."""
  log = os.path.join(c.out, "points.jsonl")
  rows = sorted(jsonl.read(log) if os.path.exists(log) else [],
                key=lambda r: (r["positions"], r["seed"]))
  cats = sorted({k for r in rows for k in r["bench"]} - {specbench.ALL})
  head = (["positions (requested)", "trained on", "seed", "steps (best)", "valid tau (est.)",
           "valid tau (rounds)", "train tau (est.)"] +
          [f"top1 d{s + 1}" for s in range(c.eval_k)] + ["Spec-Bench tau"] + cats)
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [f"{r['positions']:,}",
             f"{r['train_positions']:,}" if r.get("train_positions") else "-", str(r["seed"]),
             f"{r['steps']} ({r['best_step']})",
             f"{r['valid_tau']:.3f}",
             f"{r['valid_tau_rounds']:.3f}" if r.get("valid_tau_rounds") else "-",
             f"{r['train_tau']:.3f}"]
    cells += [f"{r[f'top1_{s}']:.3f}" for s in range(c.eval_k)]
    cells += [f"{r['bench_tau']:.3f}" if r.get("bench_tau") else "-"]
    cells += [f"{r['bench'][k]['tau']:.3f}" if k in r["bench"] else "-" for k in cats]
    lines.append("| " + " | ".join(cells) + " |")
  f = fit([r for r in rows if r.get("bench_tau")])
  md = "\n".join(lines) + "\n"
  if f:
    md += (f"\nLog-linear fit of the measured Spec-Bench tau: tau = {f['a']:.3f} + "
           f"{f['b']:.3f} ln(positions trained on), {f['per_doubling']:+.3f} per doubling of the "
           f"data; predicted at 1M: {f['a'] + f['b'] * math.log(1e6):.2f}, at 3M: "
           f"{f['a'] + f['b'] * math.log(3e6):.2f}, at 10M: "
           f"{f['a'] + f['b'] * math.log(1e7):.2f}.\n")
  with open(os.path.join(c.out, "scaling.md"), "w") as fh:
    fh.write(md)
  if rows:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("bench_tau", "Spec-Bench tau (measured)"),
                       ("valid_tau", "validation tau (estimated)"),
                       ("train_tau", "training tau (estimated)")):
      pts = [(trained_positions(r), r[key]) for r in rows if r.get(key)]
      if pts:
        ax.plot(*zip(*pts), "o", label=label)
    if f:
      xs = np.geomspace(min(trained_positions(r) for r in rows), 3e6, 50)
      ax.plot(xs, f["a"] + f["b"] * np.log(xs), "--", label="fit (measured)")
    ax.set_xscale("log")
    ax.set_xlabel("training answer positions")
    ax.set_ylabel(f"tau (k = {c.bench_k} chain, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(c.out, "scaling.png"), dpi=120)
    plt.close(fig)
  return {"rows": rows, "fit": f, "markdown": md}
