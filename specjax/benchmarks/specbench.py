"""The Spec-Bench protocol (Xia et al. 2024, arXiv:2401.07851) on any JSONL file
in its format: one record per line with `question_id`, `category` and `turns`.

Protocol:

* Every question goes through the chat template; multi-turn questions are
  answered turn by turn, the assistant's answer to turn i (the AR baseline's,
  so that every method is timed on the same prompts) appended before turn i+1.
* Per question (or per batch of `batch_size` consecutive questions of one
  category) and per turn, the AR baseline and every method run interleaved,
  `repeats` timed runs each, so all see the same machine load. A method's
  figures for a question are summed over its turns; its decode time is the
  median over repeats.
* Compile runs are excluded: the first time a (method, shape) is seen it runs
  once with a token limit of 1 (same shapes, no decode steps) untimed.
  Prompt widths are bucketed to powers of two and cache sizes are derived
  from the bucket, so each bucket compiles once per method.
* Timing is decode only (prefill reported apart), as in `GenerateResult`:
  the tokens after the first over the time after the first.
* The AR baseline is the library's fastest AR path: one while_loop on
  device, the smallest cache it needs (block 1), the same prompts and batch.
* `replay`'s reference is the AR output of the same prompt.

Aggregation per method and category (and over all categories, 'all'):

  tokens_per_s     = total decode tokens / total decode time (medians over repeats)
  ar_tokens_per_s  = the same for the interleaved AR runs
  speedup          = tokens_per_s / ar_tokens_per_s
  speedup_iqr      = [q1, q3] of the per-question speedups (each question's
                     tokens/s ratio), the spread across prompts
  tau              = tokens per target verify forward (bonus included)
  alpha            = accepted / evaluated guesses
  greedy_identical = every output equals AR's token for token (None when sampling)

Resume: every finished (question, method) is appended to `out/log.jsonl`; a
restart with the same settings skips what is there. A run killed mid-append
leaves a cut-short last line: the restart drops it (`specjax.io.jsonl`) and
redoes that question.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax import sampling as sampling_lib
from specjax import sharding
from specjax.analysis import calibration as calibration_lib
from specjax.analysis import greedy_identity
from specjax.analysis import theory
from specjax.decoding import autoregressive as ar
from specjax.decoding import batch as batch_lib
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.errors import ConfigValueError, PromptFileError
from specjax.io import jsonl
from specjax.io.load import Model, load_model
from specjax.models.cache import round_up

LOG = "log.jsonl"
PART_LOG = "log.process{}.jsonl"  # one process's records in a multi-process run
ALL = "all"
# Request ids (key derivation): question_id * TURN_IDS + turn.
TURN_IDS = 16
# Settings that change a record's numbers; a resumed log must match them.
SETTINGS = ("model", "dtype", "k", "temperature", "top_k", "top_p", "batch_size",
            "max_new_tokens", "seed", "max_ngram", "min_ngram", "layers", "draft_model",
            "checkpoint", "draft_vocab", "tree_nodes", "tree_mode", "tree_topk", "tree_width",
            "draft_stop", "mesh", "batch_invariant")


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: int
  category: str
  turns: tuple


def _question(rec, where: str) -> Question:
  """One Spec-Bench record -> Question (PromptFileError naming `where` if malformed)."""
  if not isinstance(rec, dict):
    raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  for field in ("question_id", "category", "turns"):
    if field not in rec:
      raise PromptFileError(f"{where}: record has no {field!r} (Spec-Bench JSONL expected)")
  qid, cat, turns = rec["question_id"], rec["category"], rec["turns"]
  if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < 2 ** 31 // TURN_IDS:
    raise PromptFileError(f"{where}: 'question_id' must be an integer in "
                          f"[0, {2 ** 31 // TURN_IDS}), got {str(qid)[:40]!r}")
  if not isinstance(cat, str) or not cat:
    raise PromptFileError(f"{where}: 'category' must be a non-empty string, got {str(cat)[:40]!r}")
  if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
    raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
  if len(turns) > TURN_IDS:
    raise PromptFileError(f"{where}: {len(turns)} turns, at most {TURN_IDS} supported")
  return Question(qid, cat, tuple(turns))


def load_questions(path: str, prompt_limit: Optional[int] = None) -> List[Question]:
  """Questions in file order; at most `prompt_limit` per category (None/0: all).

  Raises PromptFileError naming the file and line for a missing or unreadable
  file, a line that is not UTF-8 JSON, a record without `question_id` (a
  non-negative integer), `category` (a string) or `turns` (a non-empty list of
  strings), a repeated question_id, or a file without questions.
  """
  out, seen, ids = [], {}, {}
  try:
    f = open(path, "rb")
  except OSError as e:
    raise PromptFileError(f"{path}: cannot read the prompt file: {e}") from e
  with f:
    for n, raw in enumerate(f, 1):
      where = f"{path}:{n}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise PromptFileError(f"{where}: not UTF-8 text ({e})") from e
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except (ValueError, RecursionError) as e:  # JSONDecodeError; absurdly deep nesting
        raise PromptFileError(f"{where}: not a JSON line: {str(e)[:200]}") from e
      q = _question(rec, where)
      if q.question_id in ids:
        raise PromptFileError(f"{where}: question_id {q.question_id} repeats line "
                              f"{ids[q.question_id]}")
      ids[q.question_id] = n
      if prompt_limit and seen.get(q.category, 0) >= prompt_limit:
        continue
      seen[q.category] = seen.get(q.category, 0) + 1
      out.append(q)
  if not out:
    raise PromptFileError(f"{path}: no questions")
  return out


def make_units(questions: Sequence[Question], batch_size: int) -> List[tuple]:
  """Batches of up to `batch_size` consecutive questions of one category."""
  units, cur = [], []
  for q in questions:
    if cur and (len(cur) == batch_size or cur[0].category != q.category):
      units.append(tuple(cur))
      cur = []
    cur.append(q)
  if cur:
    units.append(tuple(cur))
  return units


def unit_id(unit: Sequence[Question]) -> str:
  return "+".join(str(q.question_id) for q in unit)


def slot_bucket(cfg, prompt_width: int, max_new_tokens: int, block: int) -> int:
  """Cache slots as a function of the (bucketed) prompt width only: one compile
  per bucket instead of one per prompt length."""
  if cfg.batch_invariant:  # AR and speculative runs: the same cache size
    block = max(block, batch_lib.INVARIANT_BLOCK)
  return min(round_up(prompt_width + max_new_tokens + block, batch_lib.SLOT_MULTIPLE),
             max(cfg.max_seq_len, prompt_width))


def _upto_eos(tokens, eos_id):
  tokens = list(tokens)
  return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


class Engine:
  """Runs AR or one drafter on a batch of prompts with bucketed shapes and
  excluded compiles; counts what it generated."""

  def __init__(self, model: Model, sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
               seed: int, mesh=None):
    self.model, self.sampling, self.max_new, self.seed = model, sampling, max_new_tokens, seed
    # On a mesh (`specjax.sharding`): weights placed once, batches padded to the data axis.
    self.mesh = mesh
    self.params = model.params if mesh is None else sharding.place_params(model.params, mesh)
    self.spec = sp.SpecConfig(sampling=sampling)
    self.seen = set()
    self.compile_s = 0.0
    self.runs = 0
    self._delta = None

  def near_tie_delta(self, prompt, continuation) -> float:
    """10x the measured max difference between a verify block's logits and
    one-token steps on this model (measured once, on the first divergence)."""
    if self._delta is None:
      diff = greedy_identity.block_vs_step_difference(self.params, self.model.cfg, prompt,
                                                      list(continuation[:5]))
      self._delta = 10 * max(diff, 1e-6)
    return self._delta

  def run(self, drafter, draft_params, prompts, request_ids):
    cfg = self.model.cfg
    block = 1 if drafter is None else max(drafter.k + 1, getattr(drafter, "block", 0))
    n, max_new = len(prompts), self.max_new
    if self.mesh is not None:
      prompts, max_new, request_ids = sharding.pad_requests(prompts, max_new, request_ids,
                                                            self.mesh)
    tokens, lengths, limits, width, slots = ar.prepare(cfg, prompts, max_new, block)
    slots = max(slots, slot_bucket(cfg, tokens.shape[1], width, block))
    if drafter is not None:
      drafter.check(cfg, draft_params)
    args = (tokens, lengths, request_ids, width, slots)
    shape = (drafter, tokens.shape, slots,
             tuple(np.shape(x) for x in jax.tree.leaves(draft_params)))
    if shape not in self.seen:  # compile with a limit of one token: no decode steps
      t0 = time.perf_counter()
      self._generate(drafter, draft_params, *args, np.ones_like(limits))
      self.compile_s += time.perf_counter() - t0
      self.seen.add(shape)
    self.runs += 1
    result = self._generate(drafter, draft_params, *args, limits)
    result.tokens = result.tokens[:n]  # without the mesh's padding rows
    return result

  def _generate(self, drafter, draft_params, tokens, lengths, request_ids, width, slots, limits):
    # `autoregressive.generate` / `speculative.generate` with the cache size fixed
    # by the bucket (theirs follows each prompt's exact length).
    params, cfg = self.params, self.model.cfg
    keys = batch_lib.request_keys(batch_lib.as_key(self.seed),
                                  batch_lib.request_ids_for(len(lengths), request_ids))
    tokens, lengths, limits = jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(limits)
    place = lambda tree: tree  # pylint: disable=unnecessary-lambda-assignment
    if self.mesh is not None:
      place = functools.partial(sharding.place_batch, batch_size=len(lengths), mesh=self.mesh)
      keys, tokens, lengths, limits = place((keys, tokens, lengths, limits))
      draft_params = sharding.place_params(draft_params, self.mesh)
    t0 = time.perf_counter()
    if drafter is None:
      state = place(ar.prefill(params, cfg, keys, tokens, lengths, limits, num_slots=slots,
                               sampling=self.sampling, max_new_tokens=width))
      state.num_tokens.block_until_ready()
      t1 = time.perf_counter()
      state = ar.decode(params, cfg, state, sampling=self.sampling)
      out, num, bad = jax.device_get((state.tokens, state.num_tokens, state.nonfinite_at))
      t2 = time.perf_counter()
      result = ar.GenerateResult(tokens=ar.unpack(out, num), prefill_s=t1 - t0,
                                 decode_s=t2 - t1, num_slots=slots,
                                 stats={"decode_steps": int(state.step)})
      ar.raise_if_nonfinite(bad, result, "autoregressive decoding")
      return result
    state = place(sp.prefill(params, cfg, drafter, draft_params, keys, tokens, lengths, limits,
                             num_slots=slots, spec=self.spec, max_new_tokens=width))
    state.num_tokens.block_until_ready()
    t1 = time.perf_counter()
    state = sp.decode(params, cfg, drafter, draft_params, state, spec=self.spec)
    history, length, plen, bad = jax.device_get((state.history, state.length, state.prompt_len,
                                                 state.nonfinite_at))
    t2 = time.perf_counter()
    out = [history[i, plen[i]:length[i]].tolist() for i in range(len(lengths))]
    result = sp.SpecResult(tokens=out, prefill_s=t1 - t0, decode_s=t2 - t1, num_slots=slots,
                           stats=sp._summarize(state), lossy=sp.is_lossy(drafter, self.spec))  # pylint: disable=protected-access
    ar.raise_if_nonfinite(bad, result, "speculative decoding")
    return result


def _decode_tokens(result) -> int:
  return sum(max(len(t) - 1, 0) for t in result.tokens)


def _new_record(unit, method, repeats, settings_id):
  rec = {"unit": unit_id(unit), "question_ids": [q.question_id for q in unit],
         "category": unit[0].category, "method": method, "settings": settings_id,
         "turns": max(len(q.turns) for q in unit), "prompt_tokens": [],
         "decode_tokens": 0, "decode_s": [0.0] * repeats, "prefill_s": [0.0] * repeats,
         "tokens": []}
  if method != "ar":
    rec.update({"ar_decode_tokens": 0, "ar_decode_s": [0.0] * repeats,
                "stats": {"rounds": 0, "emitted": 0, "proposed": 0, "accepted": 0,
                          "narrow_rounds": 0, "verified_tokens": 0},
                "identical": True})
  return rec


def chat_messages(turns: Sequence[str], answers: Sequence[str]) -> List[dict]:
  """The conversation up to the last of `turns`: user turn i, then answer i."""
  msgs = []
  for i, turn in enumerate(turns):
    msgs.append({"role": "user", "content": turn})
    if i < len(turns) - 1:
      msgs.append({"role": "assistant", "content": answers[i]})
  return msgs


def _run_unit(engine: Engine, c, unit, methods: Sequence[str], ar_done: Optional[dict],
              settings_id: str, repeats: int, note: Callable[[str, int, int], None]):
  """AR + `methods` interleaved on one unit -> records (AR's only if not done)."""
  model = engine.model
  tok, eos = model.tokenizer, model.cfg.eos_id
  recs = {m: _new_record(unit, m, repeats, settings_id) for m in ["ar", *methods]}
  recs["ar"]["answers"] = []
  built = {}
  answers = [[] for _ in unit]  # per row: AR's answer text of each turn so far
  for t in range(recs["ar"]["turns"]):
    rows = [i for i, q in enumerate(unit) if t < len(q.turns)]
    prompts = [tok.encode_chat(chat_messages(unit[i].turns[:t + 1], answers[i])) for i in rows]
    ids = [unit[i].question_id * TURN_IDS + t for i in rows]
    ref = ar_done["tokens"][t] if ar_done else None
    for rec in recs.values():
      rec["prompt_tokens"].append([len(p) for p in prompts])
    for r in range(repeats):
      note("ar", t, r)
      res = engine.run(None, None, prompts, ids)
      ref = ref or res.tokens
      _add(recs["ar"], r, res, res)
      for m in methods:
        recs[m]["ar_decode_s"][r] += res.decode_s
        if r == 0:
          recs[m]["ar_decode_tokens"] += _decode_tokens(res)
      shift = r % max(len(methods), 1)  # rotate the order across repeats
      for m in list(methods[shift:]) + list(methods[:shift]):
        if m not in built or m == "replay":
          built[m] = registry.make_drafter(m, c, model, sampling=engine.sampling, reference=ref,
                                           reference_width=engine.max_new)
        note(m, t, r)
        res = engine.run(*built[m], prompts, ids)
        _add(recs[m], r, res, ref, eos)
        if r == 0 and engine.sampling.greedy:
          recs[m].setdefault("divergences", []).extend(
              _divergences(engine, prompts, ref, res.tokens, eos, [q // TURN_IDS for q in ids]))
    texts = [tok.decode(x, skip_special_tokens=True) for x in ref]
    recs["ar"]["answers"].append(texts)
    for j, i in enumerate(rows):
      answers[i].append(texts[j])
  for m in methods:
    if not engine.sampling.greedy:
      recs[m]["identical"] = None
  return [recs[m] for m in methods] + ([] if ar_done else [recs["ar"]])


def _identity(r) -> str:
  """'True', or 'False (n rows; m at a near-tie)', or '-' when sampling."""
  if r["greedy_identical"] is None:
    return "-"
  if r["greedy_identical"] or r.get("divergent_rows") is None:
    return str(r["greedy_identical"])
  return f"False ({r['divergent_rows']} rows; {r['near_tie_rows']} at a near-tie)"


def _divergences(engine, prompts, ref, tokens, eos, question_ids) -> List[dict]:
  """Rows whose greedy output differs from AR's: the first differing position
  and AR's top-1 minus top-2 logit gap there (teacher forced), and whether
  that is a near-tie: a gap below 10x the measured difference between a verify
  block's logits and one-token steps (`greedy_identity`)."""
  out = []
  for prompt, a, b, qid in zip(prompts, ref, tokens, question_ids):
    a, b = _upto_eos(a, eos), _upto_eos(b, eos)
    if a == b:
      continue
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    gap = (greedy_identity.top_gap(engine.params, engine.model.cfg, prompt, a, pos)
           if pos < min(len(a), len(b)) else None)
    out.append({"question_id": qid, "position": pos, "gap": gap,
                "near_tie": gap is not None and gap < engine.near_tie_delta(prompt, a)})
  return out


def _add(rec, r, res, ref, eos=None):
  rec["decode_s"][r] += res.decode_s
  rec["prefill_s"][r] += res.prefill_s
  if r:
    return
  rec["decode_tokens"] += _decode_tokens(res)
  rec["tokens"].append(res.tokens)
  if "stats" in rec:
    for key in ("rounds", "emitted", "proposed", "accepted", "narrow_rounds", "verified_tokens"):
      rec["stats"][key] = rec["stats"].get(key, 0) + res.stats[key]
    hist = rec["stats"].get("accept_hist")
    new = res.stats["accept_hist"]
    rec["stats"]["accept_hist"] = new if hist is None else [a + b for a, b in zip(hist, new)]
    rec["identical"] = rec["identical"] and all(
        _upto_eos(a, eos) == _upto_eos(b, eos) for a, b in zip(res.tokens, ref))


# --- aggregation and reports --------------------------------------------------------


def _quartiles(v):
  v = sorted(x for x in v if math.isfinite(x))
  if not v:
    return [None, None]
  if len(v) == 1:
    return [v[0], v[0]]
  q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
  return [q1, q3]


def _ratio(a, b):
  return a / b if b else float("nan")


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
  alpha = _ratio(stats["accepted"], stats["proposed"])
  c = td / (k * t1)
  lev = (float(theory.leviathan_speedup(alpha, k, c)) if math.isfinite(alpha) else None)
  return {"predicted_speedup": emitted * t1 / cost, "theorem_3_8": lev,
          "draft_frac": rounds * td / cost}


def summarize(records: Sequence[dict], methods: Sequence[str], meta: dict,
              calibration: Optional[dict] = None) -> List[dict]:
  """One result per method x category (plus 'all') from per-question records.

  With `calibration` ({method: {"t_verify": {n: s}, "t_draft": s}}), each row
  also carries the calibrated prediction (`predict`) and the measured seconds
  per round."""
  out = []
  cats = list(dict.fromkeys(r["category"] for r in records))
  for m in methods:
    mine = [r for r in records if r["method"] == m]
    for cat in cats + [ALL]:
      rs = [r for r in mine if cat in (ALL, r["category"])]
      if not rs:
        continue
      dec = [statistics.median(r["decode_s"]) for r in rs]
      ar_dec = [statistics.median(r["ar_decode_s"]) for r in rs]
      tps = _ratio(sum(r["decode_tokens"] for r in rs), sum(dec))
      ar_tps = _ratio(sum(r["ar_decode_tokens"] for r in rs), sum(ar_dec))
      per_q = [_ratio(_ratio(r["decode_tokens"], d), _ratio(r["ar_decode_tokens"], a))
               for r, d, a in zip(rs, dec, ar_dec)]
      st = {k: sum(r["stats"].get(k, 0) for r in rs)
            for k in ("rounds", "emitted", "proposed", "accepted", "narrow_rounds",
                      "verified_tokens")}
      pred = (predict(st, calibration[m]) if calibration and m in calibration
              else {"predicted_speedup": None, "theorem_3_8": None, "draft_frac": None})
      hists = [r["stats"]["accept_hist"] for r in rs if r["stats"].get("accept_hist")]
      pred.update(best_k=None, best_k_predicted=None)
      tree = calibration and m in calibration and calibration[m].get("tree")
      if hists and calibration and m in calibration and not st["narrow_rounds"] and not tree:
        cal = calibration[m]
        hist = np.sum(np.asarray(hists, np.int64), axis=0)
        kb, sb, _ = theory.best_chain_length(hist, cal["k"], cal["t_verify"], cal["t_draft"])
        if math.isfinite(sb):
          pred.update(best_k=kb, best_k_predicted=sb)
      ident = [r["identical"] for r in rs]
      divs = [d for r in rs for d in r.get("divergences", [])]
      out.append({
          "method": m, "category": cat,
          "speedup": _ratio(tps, ar_tps), "speedup_iqr": _quartiles(per_q),
          "tau": _ratio(st["emitted"], st["rounds"]),
          "alpha": _ratio(st["accepted"], st["proposed"]),
          "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
          "greedy_identical": None if None in ident else all(ident),
          # rows that differ from AR, and how many of them first differ at a near-tie
          "divergent_rows": len(divs) if None not in ident else None,
          "near_tie_rows": sum(d["near_tie"] for d in divs) if None not in ident else None,
          "num_prompts": sum(len(r["question_ids"]) for r in rs),
          # per row-round; with batch_size > 1 an approximation (rows run different rounds)
          "ms_per_round": (sum(dec) / st["rounds"] * int(meta["batch_size"]) * 1e3
                           if st["rounds"] else None),
          "narrow_frac": _ratio(st["narrow_rounds"], st["rounds"]),
          **pred,
          **{k: v for k, v in meta.items() if k not in ("checkpoints", "ks")},
          "k": (meta.get("ks") or {}).get(m, meta.get("k")),
          # guesses verified per round: k for a chain, the node count for a tree
          "verify_width": (calibration[m].get("verify_width")
                           if calibration and m in calibration else None),
          "tree": bool(tree),
          "checkpoint": (meta.get("checkpoints") or {}).get(m),
      })
  return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
           for k, v in row.items()} for row in out]


def _fmt(x, spec="{:.2f}"):
  return "-" if x is None else spec.format(x)


def _guesses(r) -> str:
  """Guesses verified per round: 'k=4' for a chain, 'N=16' for a tree."""
  if r.get("tree") and r.get("verify_width"):
    return f"N={r['verify_width'] - 1}"
  return f"k={r['k']}" if r.get("k") is not None else "-"


def format_markdown(results: Sequence[dict], extra: Optional[dict] = None) -> str:
  if not results:
    return "(no results)\n"
  r0 = results[0]
  lines = [
      f"Spec-Bench protocol: {r0['precision']}, k={r0['k']}, temperature={r0['temperature']}, "
      f"top_k={r0['top_k']}, top_p={r0['top_p']}, batch_size={r0['batch_size']}, "
      f"max_new_tokens={r0['max_new_tokens']}, seed={r0['seed']}, commit={r0['commit']}",
      f"hardware: {r0['hardware']}",
      "",
      "| method | category | prompts | guesses | speedup | IQR (per prompt) | predicted | "
      "Thm 3.8 | best k (predicted) | tau | alpha | ms/round | draft share | 1-token verifies | "
      "tok/s | AR tok/s | greedy identical |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    q1, q3 = r["speedup_iqr"]
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # pylint: disable=unnecessary-lambda-assignment
    lines.append(
        f"| {r['method']} | {r['category']} | {r['num_prompts']} | {_guesses(r)} | "
        f"{_fmt(r['speedup'])}x | "
        f"{_fmt(q1)}-{_fmt(q3)} | {_fmt(r.get('predicted_speedup'))}x | "
        f"{_fmt(r.get('theorem_3_8'))}x | "
        f"{'-' if r.get('best_k') is None else r['best_k']} "
        f"({_fmt(r.get('best_k_predicted'))}x) | {_fmt(r['tau'])} | {_fmt(r['alpha'])} | "
        f"{_fmt(r.get('ms_per_round'), '{:.1f}')} | {pct(r.get('draft_frac'))} | "
        f"{pct(r.get('narrow_frac'))} | "
        f"{_fmt(r['tokens_per_s'], '{:.1f}')} | {_fmt(r['ar_tokens_per_s'], '{:.1f}')} | "
        f"{_identity(r)} |")
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


def git_commit() -> Optional[str]:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__),
                          capture_output=True, text=True, check=True,
                          timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def hardware() -> dict:
  dev = jax.devices()[0]
  return {"platform": platform.platform(), "machine": platform.machine(),
          "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
          "device_kind": dev.device_kind, "jax": jax.__version__}


# --- the run ----------------------------------------------------------------------------


def _settings(c) -> dict:
  out = {k: (c[k] if k in c else None) for k in SETTINGS}
  if not out["batch_invariant"]:  # off: records match those written before the setting existed
    del out["batch_invariant"]
  return out


def read_log(path: str) -> List[dict]:
  """The log's finished records; a last line cut short by a kill is dropped
  (and cut from the file, so the resumed run appends after whole lines)."""
  return jsonl.read(path)


def _read_logs(out: str) -> List[dict]:
  """The run directory's records: its log, then any part logs of a
  multi-process run not yet merged (a record of a unit and method once)."""
  records, seen = [], set()
  parts = sorted(glob.glob(os.path.join(out, PART_LOG.format("*"))))
  for path in [os.path.join(out, LOG)] + parts:
    for r in read_log(path):
      if (r["unit"], r["method"]) not in seen:
        seen.add((r["unit"], r["method"]))
        records.append(r)
  return records


def _clock(s: float) -> str:
  s = int(s)
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def calibrate(model: Model, c, methods: Sequence[str], unit, sampling) -> dict:
  """This machine's costs for the prediction column: target forward time for
  1 and k + 1 tokens at the first prompt's length (plus half the new tokens),
  and each drafter's proposal time, measured after the benchmark runs (so its
  compiles do not disturb them)."""
  tok = model.tokenizer
  prompt = tok.encode_chat(chat_messages(unit[0].turns[:1], []))
  fill = len(prompt) + int(c.max_new_tokens) // 2
  out = {}
  for m in methods:
    drafter, dparams = registry.make_drafter(m, c, model, sampling=sampling,
                                             reference=[[model.cfg.eos_id]],
                                             reference_width=int(c.max_new_tokens))
    k = drafter.k
    # widths 1, 2, the middle and k + 1: shorter chains are priced from this curve
    # (linear between the measured widths); a tree's verify width is its node count + 1
    width = drafter.verify_width
    ns = tuple(sorted({1, 2, (k + 2) // 2 + (k == 1), k + 1, width}))
    curve = calibration_lib.forward_cost_curve(model.params, model.cfg, ns=ns, fill=fill)
    t_draft = calibration_lib.draft_cost(model.params, model.cfg, drafter, dparams, prompt,
                                         sampling=sampling)
    out[m] = {"k": k, "t_verify": {int(n): t for n, t in curve.items()}, "t_draft": t_draft,
              "fill": fill, "verify_width": width, "tree": bool(drafter.tree)}
  return out


def _read_calibration(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    raw = json.load(f)
  for v in raw.values():  # JSON object keys are strings
    v["t_verify"] = {int(n): t for n, t in v["t_verify"].items()}
  return raw


def run_benchmark(c, model: Optional[Model] = None,
                  progress: Optional[Callable[[str], None]] = None) -> dict:
  """Run (or resume) the benchmark of config `c` (see configs/benchmark.py).

  Writes `c.out`/log.jsonl, results.json, results.md, speedup.png. Returns
  {"results": [...], "markdown": str, "runs": generations this call, ...}.
  """
  t_start = time.perf_counter()
  commit = git_commit()  # the code this process runs, before anyone commits more
  progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
  methods = [m.strip() for m in str(c.methods).split(",") if m.strip()]
  if not methods:
    raise ConfigValueError("no methods given (e.g. methods='prompt_lookup,layer_skip')")
  if len(set(methods)) != len(methods):
    raise ConfigValueError(f"methods repeat a name: {methods}")
  for m in methods:  # fail before any work on an unknown method or a bad k
    try:
      base, mc = registry.method_config(m, c)  # 'name@field=value...': the method's own fields
    except ValueError as e:
      raise ConfigValueError(str(e)) from e
    if base == "ar" or base not in registry.available_methods() + registry.LOOKAHEAD_METHODS:
      raise ConfigValueError(f"unknown method {m!r} (AR is always the baseline); available: "
                             f"{', '.join(registry.available_methods())}")
    k = mc.k
    if base not in registry.LOOKAHEAD_METHODS and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
      raise ConfigValueError(f"draft length k must be an integer >= 1, got {k!r} for {m}")
  repeats, batch_size = c.repeats, c.batch_size
  if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (repeats, batch_size)):
    raise ConfigValueError(f"repeats and batch_size must be integers >= 1, got {repeats!r}, "
                           f"{batch_size!r}")
  sampling = registry.sampling_of(c)
  units = make_units(load_questions(c.prompts, c.prompt_limit), batch_size)
  os.makedirs(c.out, exist_ok=True)
  settings = _settings(c)
  settings_id = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
  log_path = os.path.join(c.out, LOG)
  # Several processes (`distributed`): each decodes its share of the units
  # left into its own log (PART_LOG), and process 0 merges them into the log.
  # A killed job's part logs are read back on resume like the log itself.
  old = _read_logs(c.out)
  if any(r["settings"] != settings_id for r in old):
    raise ValueError(f"{log_path} holds results of other settings; use another `out` "
                     f"directory (settings now: {settings})")
  distributed.barrier("bench/read")  # every process has read the logs before any appends
  if distributed.is_primary():
    with open(os.path.join(c.out, "settings.json"), "w") as f:
      json.dump(settings, f, indent=1)
  done = {(r["unit"], r["method"]): r for r in old}

  engine = None
  todo = [u for u in units if any((unit_id(u), m) not in done for m in ["ar", *methods])]
  total_q = sum(len(u) for u in units)
  q_done = total_q - sum(len(u) for u in todo)
  if distributed.multi_process():
    todo = [todo[i] for i in distributed.local_share(len(todo))]
    log_path = os.path.join(c.out, PART_LOG.format(jax.process_index()))
  t_work = time.perf_counter()
  for n, unit in enumerate(todo):
    if engine is None:
      model = model or load_model(c.model, c.dtype, batch_invariant=c.get("batch_invariant", False))
      engine = Engine(model, sampling, int(c.max_new_tokens), int(c.seed),
                      mesh=sharding.mesh_from_config(c))
    missing = [m for m in methods if (unit_id(unit), m) not in done]
    eta = ("?" if n == 0 else
           _clock((time.perf_counter() - t_work) / n * (len(todo) - n)))

    def note(m, t, r, unit=unit, eta=eta):
      progress(f"[{q_done}/{total_q} prompts] {unit[0].category} q{unit_id(unit)} "
               f"turn {t + 1} {m} repeat {r + 1}/{repeats} | elapsed "
               f"{_clock(time.perf_counter() - t_start)}, ETA {eta}")

    recs = _run_unit(engine, c, unit, missing, done.get((unit_id(unit), "ar")), settings_id,
                     repeats, note)
    jsonl.append(log_path, recs)
    for rec in recs:
      done[(rec["unit"], rec["method"])] = rec
    q_done += len(unit)
  if distributed.multi_process():
    distributed.barrier("bench/decoded")
    if distributed.is_primary():  # merge every process's part into the log
      jsonl.write(os.path.join(c.out, LOG), _read_logs(c.out))
      for part in glob.glob(os.path.join(c.out, PART_LOG.format("*"))):
        os.remove(part)
    distributed.barrier("bench/merged")
    done = {(r["unit"], r["method"]): r for r in read_log(os.path.join(c.out, LOG))}

  wanted = {unit_id(u) for u in units}
  records = [r for (u, m), r in done.items() if u in wanted and m in methods]
  meta = {
      "temperature": sampling.temperature, "batch_size": batch_size, "k": c.k,
      "top_k": sampling.top_k, "top_p": sampling.top_p,
      "precision": engine.model.cfg.dtype if engine else str(c.dtype),
      "seed": int(c.seed), "max_new_tokens": int(c.max_new_tokens),
      "checkpoints": {m: registry.drafter_id(m, c, engine.model if engine else None)
                      for m in methods},
      "ks": {m: registry.method_config(m, c)[1].k for m in methods},
      "commit": commit, "hardware": hardware(),
  }
  calib = None
  calib_path = os.path.join(c.out, "calibration.json")
  primary = distributed.is_primary()
  if c.get("calibrate", True) and units:
    # Measured once per run directory (a resumed run reuses it; delete the file
    # to measure again); by process 0 in a multi-process run.
    calib = _read_calibration(calib_path)
    missing = [m for m in methods if m not in calib]
    if missing and primary:
      model = model or (engine.model if engine else load_model(
          c.model, c.dtype, batch_invariant=c.get("batch_invariant", False)))
      progress("calibrating: forward cost t_verify(n) and each drafter's proposal cost")
      calib.update(calibrate(model, c, missing, units[0], sampling))
      with open(calib_path, "w") as f:
        json.dump(calib, f, indent=1)
    distributed.barrier("bench/calibrated")
    if not primary:
      calib = _read_calibration(calib_path)
  results = summarize(records, methods, meta, calib)
  extra = {"repeats": repeats, "runtime_s": round(time.perf_counter() - t_start, 1),
           "compile_s": round(engine.compile_s, 1) if engine else 0.0,
           "timed_runs_this_call": engine.runs if engine else 0}
  md = format_markdown(results, extra)
  if primary:
    with open(os.path.join(c.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
    with open(os.path.join(c.out, "results.md"), "w") as f:
      f.write(md)
    plot_speedup(results, os.path.join(c.out, "speedup.png"))
  return {"results": results, "markdown": md, "runs": extra["timed_runs_this_call"],
          "runtime_s": extra["runtime_s"], "compile_s": extra["compile_s"]}
