"""The Spec-Bench protocol's report (`specbench.run_benchmark` writes it):
the markdown table of one result row per method x category and the speedup
plot with each category's IQR across prompts."""

from __future__ import annotations

from typing import Optional, Sequence

from specjax.benchmarks import report


def _identity(r) -> str:
  """'True', or 'False (n rows; m at a near-tie)', or '-' when sampling."""
  if r["greedy_identical"] is None:
    return "-"
  if r["greedy_identical"] or r.get("divergent_rows") is None:
    return str(r["greedy_identical"])
  return f"False ({r['divergent_rows']} rows; {r['near_tie_rows']} at a near-tie)"


def _guesses(r) -> str:
  """Guesses verified per round: 'k=4' for a chain, 'N=16' for a tree."""
  if r.get("tree") and r.get("verify_width"):
    return f"N={r['verify_width'] - 1}"
  return f"k={r['k']}" if r.get("k") is not None else "-"


def _vs_fastest(r) -> str:
  """The reference precision's AR tok/s, the speedup over the fastest AR, its IQR."""
  q1, q3 = r["speedup_vs_fastest_ar_iqr"]
  return (f" {report.fmt(r['reference_ar_tokens_per_s'], '{:.1f}')} | "
          f"{report.fmt(r['speedup_vs_fastest_ar'])}x | {report.fmt(q1)}-{report.fmt(q3)} |")


def format_markdown(results: Sequence[dict], extra: Optional[dict] = None) -> str:
  if not results:
    return "(no results)\n"
  r0 = results[0]
  fastest = r0.get("fastest_ar")  # with a reference precision's AR interleaved
  ref_head = (f" {r0['reference_dtype']} AR tok/s | vs fastest AR ({fastest}) | IQR |"
              if fastest else "")
  lines = [
      f"Spec-Bench protocol: {r0['precision']}, k={r0['k']}, temperature={r0['temperature']}, "
      f"top_k={r0['top_k']}, top_p={r0['top_p']}, batch_size={r0['batch_size']}, "
      f"max_new_tokens={r0['max_new_tokens']}, seed={r0['seed']}, commit={r0['commit']}",
      f"hardware: {r0['hardware']}",
      "",
      "| method | category | prompts | guesses | speedup | IQR (per prompt) | predicted | "
      "Thm 3.8 | best k (predicted) | tau | alpha | ms/round | draft share | 1-token verifies | "
      "tok/s | AR tok/s | greedy identical |" + ref_head,
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
      + ("---|---|---|" if fastest else ""),
  ]
  for r in results:
    q1, q3 = r["speedup_iqr"]
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # pylint: disable=unnecessary-lambda-assignment
    lines.append(
        f"| {r['method']} | {r['category']} | {r['num_prompts']} | {_guesses(r)} | "
        f"{report.fmt(r['speedup'])}x | "
        f"{report.fmt(q1)}-{report.fmt(q3)} | {report.fmt(r.get('predicted_speedup'))}x | "
        f"{report.fmt(r.get('theorem_3_8'))}x | "
        f"{'-' if r.get('best_k') is None else r['best_k']} "
        f"({report.fmt(r.get('best_k_predicted'))}x) | {report.fmt(r['tau'])} | {report.fmt(r['alpha'])} | "
        f"{report.fmt(r.get('ms_per_round'), '{:.1f}')} | {pct(r.get('draft_frac'))} | "
        f"{pct(r.get('narrow_frac'))} | "
        f"{report.fmt(r['tokens_per_s'], '{:.1f}')} | {report.fmt(r['ar_tokens_per_s'], '{:.1f}')} | "
        f"{_identity(r)} |" + (_vs_fastest(r) if fastest else ""))
  if extra:
    lines += ["", ", ".join(f"{k}: {v}" for k, v in extra.items())]
  return "\n".join(lines) + "\n"


def plot_speedup(results: Sequence[dict], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  methods = list(dict.fromkeys(r["method"] for r in results))
  cats = list(dict.fromkeys(r["category"] for r in results))
  width = 0.8 / max(len(methods), 1)
  fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cats) * max(1, len(methods) / 2)), 4))
  for i, m in enumerate(methods):
    rows = {r["category"]: r for r in results if r["method"] == m}
    xs = [j + (i - (len(methods) - 1) / 2) * width for j, c in enumerate(cats) if c in rows]
    ys = [rows[c]["speedup"] or 0.0 for c in cats if c in rows]
    lo = [max(y - (rows[c]["speedup_iqr"][0] or y), 0) for c, y in zip(
        [c for c in cats if c in rows], ys)]
    hi = [max((rows[c]["speedup_iqr"][1] or y) - y, 0) for c, y in zip(
        [c for c in cats if c in rows], ys)]
    ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=m)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xticks(range(len(cats)), cats)
  ax.set_ylabel("decode speedup over AR (IQR across prompts)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
