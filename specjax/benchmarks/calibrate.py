"""A benchmark run's calibration: this machine's measured costs (target forward
time per verify width, each drafter's proposal time) and the speedup they
predict from a method's measured round counts, beside the measured one."""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

from specjax.analysis import calibration as calibration_lib
from specjax.analysis import theory
from specjax.benchmarks import report
from specjax.benchmarks.questions import chat_messages
from specjax.drafters import registry
from specjax.io.load import Model


def predict(stats: dict, calib: dict) -> dict:
  """The calibrated prediction of a method's speedup from its measured round
  counts and this machine's measured costs (no decode timing enters it):

    cost per round = t_draft + t_verify(k + 1)   (t_verify(1) for rounds in
                                                  which nothing was proposed;
                                                  for drafters of variable length
                                                  t_verify at the mean width the
                                                  other rounds used, interpolated)
    predicted speedup = emitted tokens * t_verify(1) / total cost

  and Leviathan et al.'s Theorem 3.8 value, which prices a verify like one AR
  step: (1 - a^(k+1)) / ((1 - a)(k c + 1)), c = t_draft / (k t_verify(1)).

  Calibrated at batch size B > 1 (`calib["batch_size"]`, costs of B-row
  forwards) with the batches' own counts (`batch_rounds`: each batch's rounds
  until its last row is done; `ar_batch_steps`: AR's steps until its longest
  row is done), a batch pays for its slowest row, speculative and AR alike:

    predicted speedup = ar_batch_steps * t_verify(1) / (batch_rounds * (t_draft + t_verify(k + 1)))

  (every batch round priced at the full verify width). Without those counts
  (logs from before they were kept) the per-row formula above stands, which
  assumes balanced rows and overstates a batch whose rows finish unevenly.
  """
  rounds, emitted = stats["rounds"], stats["emitted"]
  narrow = stats.get("narrow_rounds", 0)
  k = calib["k"]
  width = calib.get("verify_width", k + 1)  # N + 1 for a tree of N nodes
  t1, tk, td = calib["t_verify"][1], calib["t_verify"][width], calib["t_draft"]
  if not rounds:
    return {"predicted_speedup": None, "theorem_3_8": None, "draft_frac": None}
  verified = stats.get("verified_tokens", 0)
  if verified and rounds > narrow:
    tk = theory.interpolate_cost(calib["t_verify"])((verified - narrow) / (rounds - narrow))
  cost = rounds * td + narrow * t1 + (rounds - narrow) * tk
  predicted = emitted * t1 / cost
  if calib.get("batch_size", 1) > 1 and stats.get("batch_rounds") and stats.get("ar_batch_steps"):
    cost = stats["batch_rounds"] * (td + calib["t_verify"][width])
    predicted = stats["ar_batch_steps"] * t1 / cost
    rounds = stats["batch_rounds"]
  alpha = report.ratio(stats["accepted"], stats["proposed"])
  c = td / (k * t1)
  lev = (float(theory.leviathan_speedup(alpha, k, c)) if math.isfinite(alpha) else None)
  return {"predicted_speedup": predicted, "theorem_3_8": lev, "draft_frac": rounds * td / cost}


def calibrate(model: Model, drafter_settings, methods: Sequence[str], unit, sampling,
              max_new_tokens: int, batch_size: int = 1) -> dict:
  """This machine's costs for the prediction column: target forward time for
  1 and k + 1 tokens at the first prompt's length (plus half the new tokens),
  and each drafter's proposal time, measured after the benchmark runs (so its
  compiles do not disturb them).

  At the run's batch size: B rows of a batch advance in one forward, so a
  round's cost and an AR step's are those of B-row forwards (B x (k + 1)
  positions for a verify: free while the weights' read dominates, not once
  the rows fill the arithmetic); `predict` prices the batches' rounds and AR
  steps with them."""
  tok = model.tokenizer
  prompt = tok.encode_chat(chat_messages(unit[0].turns[:1], []))
  fill = len(prompt) + max_new_tokens // 2
  out = {}
  for m in methods:
    drafter, dparams = registry.make_drafter(m, drafter_settings, model, sampling=sampling,
                                             reference=[[model.cfg.eos_id]],
                                             reference_width=max_new_tokens)
    k = drafter.k
    # widths 1, 2, the middle and k + 1: shorter chains are priced from this curve
    # (linear between the measured widths); a tree's verify width is its node count + 1
    width = drafter.verify_width
    ns = tuple(sorted({1, 2, (k + 2) // 2 + (k == 1), k + 1, width}))
    curve = calibration_lib.forward_cost_curve(model.params, model.cfg, ns=ns, fill=fill,
                                               batch_size=batch_size)
    t_draft = calibration_lib.draft_cost(model.params, model.cfg, drafter, dparams, prompt,
                                         sampling=sampling, batch_size=batch_size)
    out[m] = {"k": k, "t_verify": {int(n): t for n, t in curve.items()}, "t_draft": t_draft,
              "fill": fill, "verify_width": width, "tree": bool(drafter.tree),
              "batch_size": batch_size}
  return out


def read_calibration(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    raw = json.load(f)
  for v in raw.values():  # JSON object keys are strings
    v["t_verify"] = {int(n): t for n, t in v["t_verify"].items()}
  return raw
