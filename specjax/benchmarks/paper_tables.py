"""The papers' tables, measured here: each one a set of Spec-Bench runs
(`specbench.run_benchmark`, resumable, AR measured interleaved in the same
process) summarised into markdown + JSON + PNG under `out/<table>/`.

  leviathan  acceptance rate alpha (and tau) of every method under greedy and
             T = 1 (Leviathan et al. 2023, Table 3's form)
  specbench  per-category speedup and tau of every method side by side
             (Medusa / EAGLE / Spec-Bench form; leviathan's greedy run)
  gamma      the draft-length sweep: measured walltime improvement at each k
             next to Theorem 3.8's value from the measured alpha and cost c,
             and the calibrated prediction (measured verify costs); the
             optimal k of each
  batch      speedup of each method vs batch size B (B consecutive prompts
             of a category decoded together): where speculation stops paying;
             beside it the prediction calibrated with B-row forwards
  expected   the expected-tokens curve (1 - alpha^(k+1)) / (1 - alpha)
             against measured tokens per round, for every k' <= k read off
             the acceptance histogram of a k-run

Each table takes a `PaperTablesSettings` (every Spec-Bench setting, with the
tables' own defaults, plus the tables' fields); the runs behind it are
`specbench.BenchmarkSettings` of the same values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Dict, List, Optional

import numpy as np

from specjax import distributed
from specjax.analysis import theory
from specjax.benchmarks import report
from specjax.benchmarks import specbench
from specjax.checks import require_whole_list
from specjax.drafters import registry
from specjax.settings import require

TABLES = ("leviathan", "specbench", "gamma", "batch", "expected")


@dataclasses.dataclass(frozen=True)
class PaperTablesSettings(specbench.BenchmarkSettings):
  """The papers' tables (`experiments/paper_tables.py`, configs/paper_tables.py):
  the Spec-Bench runs' settings (`specbench.BenchmarkSettings`, the fields
  not redefined here keep its defaults) and the tables' own."""

  methods: str = "draft_model,eagle3,prompt_lookup"  # comma-separated drafters; AR always runs
  prompt_limit: Optional[int] = 1  # questions per category; None / 0: all
  max_new_tokens: int = 96
  repeats: int = 2  # timed runs per method and question, interleaved with AR
  out: str = "/tmp/specjax_tables"  # each table under out/<table>/, its runs below it
  tables: str = "all"  # leviathan, specbench, gamma, batch, expected (comma-separated) or all
  ks: str = "1,2,3,4,6,8"  # gamma: the draft lengths swept
  batch_sizes: str = "1,2,4,8,16,32"  # batch: B consecutive prompts of a category per unit


def _sub(c: PaperTablesSettings, out: str, **fields) -> specbench.BenchmarkSettings:
  """The Spec-Bench run of settings `c` with `fields` changed and its own out dir
  (its settings, and so its log's settings id, those of the same values given to
  experiments/benchmark.py)."""
  values = {f.name: getattr(c, f.name) for f in dataclasses.fields(specbench.BenchmarkSettings)}
  return specbench.BenchmarkSettings(**{**values, **fields, "out": out})


def _methods(c: PaperTablesSettings) -> List[str]:
  return report.comma_list(c.methods)


def _ks(c: PaperTablesSettings) -> List[int]:
  """gamma's draft lengths, distinct, each >= 1."""
  return require_whole_list("ks", c.ks, 1, why="gamma's draft lengths", distinct=True)


def _batch_sizes(c: PaperTablesSettings) -> List[int]:
  """batch's batch sizes, distinct, each >= 1."""
  return require_whole_list("batch_sizes", c.batch_sizes, 1, why="batch's batch sizes",
                            distinct=True)


def _overall(results) -> Dict[str, dict]:
  return {r["method"]: r for r in results if r["category"] == specbench.ALL}


def _run_overall(sub, model, progress) -> Dict[str, dict]:
  """Run (or resume) one sub-benchmark -> its overall row per method."""
  return _overall(specbench.run_benchmark(sub, model=model, progress=progress)["results"])


def _write(out: str, name: str, rows: List[dict], md_lines: List[str],
           plot: Optional[Callable] = None) -> dict:
  """out/name.{json,md,png} -> {"rows", "markdown"}."""
  md = "\n".join(md_lines) + "\n"
  if not distributed.is_primary():  # a multi-process run: process 0 writes
    return {"rows": rows, "markdown": md}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(out, f"{name}.md"), "w") as f:
    f.write(md)
  if plot is not None:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 4))
    plot(ax)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=120)
    plt.close(fig)
  return {"rows": rows, "markdown": md}


def leviathan(c: PaperTablesSettings, model=None, progress=None) -> dict:
  require(c, PaperTablesSettings, "paper_tables.leviathan")
  out = os.path.join(c.out, "leviathan")
  runs = {}
  for label, temp in (("greedy", 0.0), ("T=1", 1.0)):
    sub = _sub(c, os.path.join(out, label.replace("=", "")),
               sampling=dataclasses.replace(c.sampling, temperature=temp))
    runs[label] = _run_overall(sub, model, progress)
  rows = [{"method": m, **{f"alpha_{lab}": runs[lab][m]["alpha"] for lab in runs},
           **{f"tau_{lab}": runs[lab][m]["tau"] for lab in runs},
           **{f"speedup_{lab}": runs[lab][m]["speedup"] for lab in runs},
           "k": runs["greedy"][m]["k"]}
          for m in _methods(c)]
  md = ["| method | k | alpha (greedy) | alpha (T = 1) | tau (greedy) | tau (T = 1) | "
        "speedup (greedy) | speedup (T = 1) |", "|---|---|---|---|---|---|---|---|"]
  md += [f"| {r['method']} | {r['k']} | {report.fmt(r['alpha_greedy'])} | "
         f"{report.fmt(r['alpha_T=1'])} | {report.fmt(r['tau_greedy'])} | "
         f"{report.fmt(r['tau_T=1'])} | {report.fmt(r['speedup_greedy'])}x | "
         f"{report.fmt(r['speedup_T=1'])}x |" for r in rows]

  def plot(ax):
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["alpha_greedy"] or 0 for r in rows], 0.4, label="greedy")
    ax.bar(x + 0.2, [r["alpha_T=1"] or 0 for r in rows], 0.4, label="T = 1")
    ax.set_xticks(x, [r["method"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("alpha"); ax.legend()

  return _write(out, "leviathan", rows, md, plot)


def specbench_table(c: PaperTablesSettings, model=None, progress=None) -> dict:
  """Medusa / EAGLE / Spec-Bench form: per-category speedup and tau of every
  method side by side (the greedy run of the leviathan table: one run serves both)."""
  require(c, PaperTablesSettings, "paper_tables.specbench_table")
  out = os.path.join(c.out, "specbench")
  sub = _sub(c, os.path.join(c.out, "leviathan", "greedy"),
             sampling=dataclasses.replace(c.sampling, temperature=0.0))
  results = specbench.run_benchmark(sub, model=model, progress=progress)["results"]
  cats = []
  for r in results:
    if r["category"] != specbench.ALL and r["category"] not in cats:
      cats.append(r["category"])
  cats.append(specbench.ALL)
  by = {(r["method"], r["category"]): r for r in results}
  rows = [{"method": m, "category": cat, "speedup": by[m, cat]["speedup"],
           "speedup_median": by[m, cat].get("speedup_median"),
           "speedup_iqr": by[m, cat]["speedup_iqr"], "num_prompts": by[m, cat]["num_prompts"],
           "tau": by[m, cat]["tau"], "alpha": by[m, cat]["alpha"],
           "tokens_per_s": by[m, cat]["tokens_per_s"],
           "ar_tokens_per_s": by[m, cat]["ar_tokens_per_s"],
           "greedy_identical": by[m, cat]["greedy_identical"],
           **{k: by[m, cat].get(k) for k in (
               "fastest_ar", "reference_dtype", "reference_ar_tokens_per_s",
               "speedup_vs_fastest_ar", "speedup_vs_fastest_ar_median",
               "speedup_vs_fastest_ar_iqr")}}
          for m in _methods(c) for cat in cats if (m, cat) in by]
  prompts = {x: next((r["num_prompts"] for r in rows if r["category"] == x), 0) for x in cats}
  # with a reference precision's AR interleaved: the speedups over the fastest AR of the two
  fastest = next((r["fastest_ar"] for r in rows if r.get("fastest_ar")), None)
  over = "AR" if not fastest else (
      f"the fastest AR ({fastest}; AR in {sub.dtype} and {rows[0]['reference_dtype']} "
      f"interleaved)")
  md = [f"Speedup over {over} per Spec-Bench category: the median of the per-prompt speedups "
        f"[IQR across prompts] (tau, tokens per target forward); temperature "
        f"{sub.sampling.temperature}, B = {sub.batch_size}, {sub.max_new_tokens} new tokens, "
        f"{sub.dtype}.", "",
        "| method | " + " | ".join(("overall" if x == specbench.ALL else x) + f" ({prompts[x]})"
                                  for x in cats) + " |",
        "|---|" + "---|" * len(cats)]

  def cell(r):
    med, (q1, q3) = ((r.get("speedup_median"), r["speedup_iqr"]) if not fastest else
                     (r["speedup_vs_fastest_ar_median"], r["speedup_vs_fastest_ar_iqr"]))
    return f"{report.fmt(med)}x [{report.fmt(q1)}-{report.fmt(q3)}] ({report.fmt(r['tau'])})"

  for m in _methods(c):
    md.append(f"| {m} | " + " | ".join(cell(by[m, x]) if (m, x) in by else "-"
                                        for x in cats) + " |")
  ar_rows = [("AR tok/s" if not fastest else f"AR tok/s ({sub.dtype})", "ar_tokens_per_s")]
  if fastest:
    ar_rows.append((f"AR tok/s ({rows[0]['reference_dtype']})", "reference_ar_tokens_per_s"))
  for label, key in ar_rows:
    md.append(f"| {label} | " + " | ".join(
        report.fmt(next((r[key] for r in rows if r["category"] == x), None), "{:.1f}")
        for x in cats) + " |")

  def plot(ax):
    x = np.arange(len(cats))
    width = 0.8 / max(len(_methods(c)), 1)
    for i, m in enumerate(_methods(c)):
      ax.bar(x + (i - (len(_methods(c)) - 1) / 2) * width,
             [by[m, cat][key] if (m, cat) in by else 0 for cat in cats], width, label=m)
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xticks(x, ["overall" if cat == specbench.ALL else cat for cat in cats],
                  rotation=20, ha="right")
    ax.set_ylabel("speedup over AR" if not fastest else f"speedup over {fastest} AR")
    ax.legend(fontsize=6, ncol=2)

  key = "speedup_vs_fastest_ar" if fastest else "speedup"

  return _write(out, "specbench", rows, md, plot)


def gamma(c: PaperTablesSettings, model=None, progress=None) -> dict:
  require(c, PaperTablesSettings, "paper_tables.gamma")
  out = os.path.join(c.out, "gamma")
  ks = _ks(c)
  rows = []
  for m in _methods(c):
    sub = _sub(c, os.path.join(out, m.replace("@", "_")),
               methods=",".join(f"{m}@k={k}" for k in ks))
    res = _run_overall(sub, model, progress)
    for k in ks:
      r = res[f"{m}@k={k}"]
      rows.append({"method": m, "k": k, "alpha": r["alpha"], "tau": r["tau"],
                   "speedup": r["speedup"], "theorem_3_8": r.get("theorem_3_8"),
                   "predicted_speedup": r.get("predicted_speedup")})
  md = ["| method | k | alpha | tau | measured | calibrated prediction | Thm 3.8 |",
        "|---|---|---|---|---|---|---|"]
  md += [f"| {r['method']} | {r['k']} | {report.fmt(r['alpha'])} | {report.fmt(r['tau'])} | "
         f"{report.fmt(r['speedup'])}x | {report.fmt(r['predicted_speedup'])}x | "
         f"{report.fmt(r['theorem_3_8'])}x |" for r in rows]
  md.append("")
  for m in _methods(c):
    mine = [r for r in rows if r["method"] == m]
    best = {key: max(mine, key=lambda r, key=key: r[key] or 0)["k"]
            for key in ("speedup", "predicted_speedup", "theorem_3_8")}
    md.append(f"- {m}: optimal k measured {best['speedup']}, calibrated "
              f"{best['predicted_speedup']}, Thm 3.8 {best['theorem_3_8']}")

  def plot(ax):
    for m in _methods(c):
      mine = [r for r in rows if r["method"] == m]
      line, = ax.plot([r["k"] for r in mine], [r["speedup"] for r in mine], "o-", label=m)
      ax.plot([r["k"] for r in mine], [r["theorem_3_8"] or np.nan for r in mine], ":",
              color=line.get_color())
      ax.plot([r["k"] for r in mine], [r["predicted_speedup"] or np.nan for r in mine], "--",
              color=line.get_color())
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xlabel("k (solid: measured, dashed: calibrated, dotted: Thm 3.8)")
    ax.set_ylabel("speedup over AR"); ax.legend()

  return _write(out, "gamma", rows, md, plot)


def batch(c: PaperTablesSettings, model=None, progress=None) -> dict:
  require(c, PaperTablesSettings, "paper_tables.batch")
  out = os.path.join(c.out, "batch")
  sizes = _batch_sizes(c)
  rows = []
  for b in sizes:
    sub = _sub(c, os.path.join(out, f"B{b}"), batch_size=b,
               prompt_limit=max(b, int(c.prompt_limit or 1)))
    res = _run_overall(sub, model, progress)
    for m in _methods(c):
      r = res[m]
      rows.append({"method": m, "batch_size": b, "speedup": r["speedup"], "tau": r["tau"],
                   "tokens_per_s": r["tokens_per_s"], "ar_tokens_per_s": r["ar_tokens_per_s"],
                   # from the round counts and forwards of B rows (the run's calibration)
                   "predicted_speedup": r["predicted_speedup"]})
  md = ["| method | " + " | ".join(f"B = {b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes)]
  for m in _methods(c):
    by = {r["batch_size"]: r for r in rows if r["method"] == m}
    md.append(f"| {m} | " + " | ".join(f"{report.fmt(by[b]['speedup'])}x" for b in sizes) + " |")
    if any(by[b]["predicted_speedup"] is not None for b in sizes):  # calibrate=False: none
      md.append(f"| {m}, calibrated prediction | " + " | ".join(
          report.fmt(by[b]["predicted_speedup"], suffix="x") for b in sizes) + " |")
  md.append("| AR tok/s | " + " | ".join(
      report.fmt(next(r for r in rows if r["batch_size"] == b)["ar_tokens_per_s"], "{:.1f}")
      for b in sizes) + " |")

  def plot(ax):
    for m in _methods(c):
      mine = [r for r in rows if r["method"] == m]
      line, = ax.plot([r["batch_size"] for r in mine], [r["speedup"] for r in mine], "o-",
                      label=m)
      ax.plot([r["batch_size"] for r in mine],
              [r["predicted_speedup"] or np.nan for r in mine], "--", color=line.get_color())
    ax.axhline(1, color="k", lw=0.5); ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (solid: measured, dashed: calibrated at B)")
    ax.set_ylabel("speedup over AR at the same B"); ax.legend()

  return _write(out, "batch", rows, md, plot)


def expected(c: PaperTablesSettings, model=None, progress=None) -> dict:
  require(c, PaperTablesSettings, "paper_tables.expected")
  out = os.path.join(c.out, "expected")
  sub = _sub(c, os.path.join(out, "run"))
  specbench.run_benchmark(sub, model=model, progress=progress)
  records = specbench.read_log(os.path.join(sub.out, specbench.LOG))
  rows = []
  for m in _methods(c):
    mine = [r for r in records if r["method"] == m and r.get("stats", {}).get("accept_hist")]
    if not mine:
      continue
    hist = np.sum(np.asarray([r["stats"]["accept_hist"] for r in mine], np.int64), axis=0)
    k = len(hist) - 1
    # alpha: accepted / evaluated guesses (up to and including the first rejection)
    evaluated = sum(r["stats"]["proposed"] for r in mine)
    alpha = sum(r["stats"]["accepted"] for r in mine) / evaluated if evaluated else float("nan")
    for kk in range(1, k + 1):
      rows.append({"method": m, "k": kk, "alpha": alpha,
                   "measured_tokens": theory.chain_tokens_from_histogram(hist, kk),
                   "formula_tokens": float(theory.expected_tokens(alpha, kk))})
  md = ["| method | k | alpha | measured tokens / round | (1 - alpha^(k+1)) / (1 - alpha) |",
        "|---|---|---|---|---|"]
  md += [f"| {r['method']} | {r['k']} | {report.fmt(r['alpha'])} | "
         f"{report.fmt(r['measured_tokens'])} | {report.fmt(r['formula_tokens'])} |" for r in rows]

  def plot(ax):
    for m in dict.fromkeys(r["method"] for r in rows):
      mine = [r for r in rows if r["method"] == m]
      line, = ax.plot([r["k"] for r in mine], [r["measured_tokens"] for r in mine], "o", label=m)
      ax.plot([r["k"] for r in mine], [r["formula_tokens"] for r in mine], "-",
              color=line.get_color())
    ax.set_xlabel("k (points: measured; lines: i.i.d. formula)")
    ax.set_ylabel("tokens per round"); ax.legend()

  return _write(out, "expected", rows, md, plot)


def run(c: PaperTablesSettings, model=None, progress=None) -> Dict[str, dict]:
  """Run the tables named in `c.tables` (comma-separated, or 'all') with
  settings `c` (`PaperTablesSettings.of` reads configs/paper_tables.py's ConfigDict)."""
  require(c, PaperTablesSettings, "paper_tables.run")
  names = TABLES if str(c.tables) == "all" else [t.strip() for t in str(c.tables).split(",")]
  for name in names:
    if name not in TABLES:
      raise ValueError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
  for m in _methods(c):
    registry.parse_method(m)  # fail before any work on a malformed method
  if "gamma" in names:
    _ks(c)  # likewise a malformed list, before the tables before it run
  if "batch" in names:
    _batch_sizes(c)
  return {name: _TABLE_FNS[name](c, model=model, progress=progress) for name in names}


_TABLE_FNS = {"leviathan": leviathan, "specbench": specbench_table, "gamma": gamma,
              "batch": batch, "expected": expected}
