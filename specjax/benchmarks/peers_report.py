"""The peers comparison's report (`peers.run_peers` writes it): each
implementation's fastest row against specjax's, and the markdown table of
one row per system and mode with the settings every system ran with."""

from __future__ import annotations

from typing import List

from specjax.benchmarks import report

# The implementations, as the table names them.
SPECJAX, HF, LLAMACPP = "specjax", "HF transformers", "llama.cpp"


def _ratio(a, b):
  return report.ratio(a, b, missing=None)


def best_against_best(rows: List[dict]) -> List[dict]:
  """specjax's fastest row against each peer's fastest row."""
  fastest = {}
  for r in rows:
    if r["tokens_per_s"] is not None and (r["impl"] not in fastest or
                                          r["tokens_per_s"] > fastest[r["impl"]]["tokens_per_s"]):
      fastest[r["impl"]] = r
  mine = fastest.get(SPECJAX)
  if mine is None:
    return []
  return [{"peer": impl, "peer_mode": r["mode"], "peer_tokens_per_s": r["tokens_per_s"],
           "specjax_mode": mine["mode"], "specjax_tokens_per_s": mine["tokens_per_s"],
           "ratio": _ratio(mine["tokens_per_s"], r["tokens_per_s"])}
          for impl, r in fastest.items() if impl != SPECJAX]


def format_markdown(out: dict) -> str:
  """The results dict of `peers.run_peers` as its markdown report."""
  rows, c = out["results"], out["config"]
  lines = [
      f"Peers side by side: {out['num_prompts']} prompts ({c['prompts']}, prompt_limit "
      f"{c['prompt_limit']} per category), greedy, batch 1, max_new_tokens "
      f"{c['max_new_tokens']}, {c['repeats']} repeats (median), interleaved in one process; "
      f"specjax {out['settings'][SPECJAX]['precision']}; commit {out['commit']}",
      f"hardware: {out['hardware']}",
      "",
      "| system | mode | k | n-gram | decode tok/s | vs own AR | vs HF AR | tokens/round | "
      "prefill s | greedy identical to own AR |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['impl']} | {r['mode']} | {report.fmt(r['k'], '{}')} | "
        f"{report.fmt(r['ngram'], '{}')} | {report.fmt(r['tokens_per_s'], '{:.1f}')} | "
        f"{report.fmt(r['speedup_vs_own_ar'], suffix='x')} | "
        f"{report.fmt(r['speedup_vs_hf_ar'], suffix='x')} | {report.fmt(r['tokens_per_round'])} | "
        f"{report.fmt(r['prefill_s'], '{:.2f}')} | "
        f"{'-' if r['greedy_identical'] is None else r['greedy_identical']} |")
  for impl, why in out["skipped"].items():
    lines.append(f"| {impl} | skipped: {why} | - | - | - | - | - | - | - | - |")
  lines += ["", "Settings:"]
  for key, s in out["settings"].items():
    lines.append(f"- {key}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
  lines += ["", "Best against best (the fastest row of each system, same prompts):"]
  bab = out["best_against_best"]
  if not bab:
    lines.append("- no peer ran.")
  for b in bab:
    lines.append(f"- specjax {b['specjax_mode']} {report.fmt(b['specjax_tokens_per_s'], '{:.1f}')} "
                 f"tok/s vs {b['peer']} {b['peer_mode']} "
                 f"{report.fmt(b['peer_tokens_per_s'], '{:.1f}')} tok/s: "
                 f"{report.fmt(b['ratio'], suffix='x')}")
  lines += ["", f"runtime {out['runtime_s']:.0f} s, specjax compiles {out['compile_s']:.0f} s "
            "(excluded from every figure)."]
  return "\n".join(lines) + "\n"
