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
* With `reference_dtype` (e.g. float32 beside a bfloat16 run), AR also runs in
  that precision (its own model, the default forward), interleaved beside
  the run's own AR in every repeat (before it in every other unit, turn and
  repeat, after it in the rest, so neither AR gains from its place in the
  order): a method is then also measured
  against the fastest AR of the two precisions (the one with the higher
  tokens/s over the whole run), since the precision that verifies blocks
  cheapest need not be the one that decodes one token fastest.

Aggregation per method and category (and over all categories, 'all'):

  tokens_per_s     = total decode tokens / total decode time (medians over repeats)
  ar_tokens_per_s  = the same for the interleaved AR runs
  speedup          = tokens_per_s / ar_tokens_per_s
  speedup_median   = the median of the per-question speedups (each question's
                     tokens/s ratio)
  speedup_iqr      = [q1, q3] of the per-question speedups, the spread across prompts
  tau              = tokens per target verify forward (bonus included)
  alpha            = accepted / evaluated guesses
  greedy_identical = every output equals AR's token for token (None when sampling)
  fastest_ar       = with `reference_dtype`: the precision whose AR had the higher
                     tokens/s over the run (else None)
  speedup_vs_fastest_ar (and _median, _iqr) = the same as speedup (and its
                     median, IQR) against that precision's interleaved AR runs

Resume: every finished (question, method) is appended to `out/log.jsonl`; a
restart with the same settings skips what is there. A run killed mid-append
leaves a cut-short last line: the restart drops it (`specjax.io.jsonl`) and
redoes that question.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence

import jax
import numpy as np

from specjax import distributed
from specjax import sampling as sampling_lib
from specjax import sharding
from specjax.analysis import greedy_identity
from specjax.analysis import theory
from specjax.benchmarks import calibrate as calibrate_lib
from specjax.benchmarks import report
from specjax.benchmarks import specbench_report
from specjax.benchmarks.questions import (SPEC_BENCH, TURN_IDS, chat_messages, load_questions,
                                         make_units, unit_id)
from specjax.checks import require_whole
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.settings import DrafterSettings
from specjax.errors import ConfigValueError
from specjax.io import jsonl
from specjax.io.load import Model, load_model
from specjax.models import invariant as invariant_lib
from specjax.settings import RunSettings, require

LOG = "log.jsonl"
PART_LOG = "log.process{}.jsonl"  # one process's records in a multi-process run
ALL = "all"
# Settings that change a record's numbers; a resumed log must match them.
SETTINGS = ("model", "dtype", "k", "temperature", "top_k", "top_p", "batch_size",
            "max_new_tokens", "seed", "max_ngram", "min_ngram", "layers", "draft_model",
            "checkpoint", "draft_vocab", "tree_nodes", "tree_mode", "tree_topk", "tree_width",
            "draft_stop", "mesh", "batch_invariant", "invariant_tile", "reference_dtype")


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings(RunSettings):
  """A Spec-Bench run (`experiments/benchmark.py`, configs/benchmark.py)."""

  model: str = "smollm2-135m"
  dtype: str = "float32"
  # decode forwards bit for bit independent of the block (specjax.models.invariant):
  # greedy speculative output equals greedy AR token for token. None: the
  # precision's default (invariant.default_for: on in bfloat16 on the CPU, off a mesh)
  batch_invariant: Optional[bool] = None
  invariant_tile: int = 0  # its rows per tile (ModelConfig.invariant_tile; 0: the default)
  # AR also in this precision (e.g. 'float32' beside a bfloat16 run), interleaved:
  # speedups also over the fastest AR of the two ('': the run's own AR only)
  reference_dtype: str = ""
  prompts: str = SPEC_BENCH  # any JSONL file in Spec-Bench's format
  methods: str = "prompt_lookup,layer_skip"  # comma-separated drafters; AR is always run
  prompt_limit: Optional[int] = None  # questions per category; None: all
  max_new_tokens: int = 128
  batch_size: int = 1  # consecutive questions of one category decoded together
  seed: int = 0
  repeats: int = 3  # timed runs per method and question, interleaved with AR
  out: str = "/tmp/specjax_benchmark"
  # several processes of one JAX job on this machine share the units
  # (loopback, gloo); each decodes on its own local_devices (0: JAX's default)
  processes: int = 1
  local_devices: int = 0
  calibrate: bool = True  # measure forward / drafter costs for the predicted-speedup column
  mesh: str = ""  # 'data,model' device mesh (specjax.sharding); '': the default device
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  drafter: DrafterSettings = DrafterSettings()


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
    """10x the measured max difference between a 16-token block's logits and
    one-token steps on this model (measured once, on the first divergence).
    16 tokens: a block of up to 8 takes the few-row kernel where it runs and
    then equals one-token steps bit for bit (a 5-token block measured 0.0 in
    bfloat16 in session 35, while answers still diverged at top-2 gaps of
    0.001-0.08), so a narrower block would call every divergence a non-tie."""
    if self._delta is None:
      diff = greedy_identity.block_vs_step_difference(self.params, self.model.cfg, prompt,
                                                      list(continuation[:16]))
      self._delta = 10 * max(diff, 1e-6)
    return self._delta

  def run(self, drafter, draft_params, prompts, request_ids):
    """`autoregressive.generate` (drafter None) or `speculative.generate` on one
    batch; the first run of a (method, shape) is preceded by an untimed one of
    the same programs with every limit at 1 token (no decode steps)."""
    cfg = self.model.cfg
    tokens, _, _, _, slots = ar.prepare(
        cfg, prompts, self.max_new,
        1 if drafter is None else max(drafter.k + 1, drafter.block))
    shape = (drafter, tokens.shape, slots,
             tuple(np.shape(x) for x in jax.tree.leaves(draft_params)))
    if shape not in self.seen:
      t0 = time.perf_counter()
      self._generate(drafter, draft_params, prompts, request_ids, 1)
      self.compile_s += time.perf_counter() - t0
      self.seen.add(shape)
    self.runs += 1
    return self._generate(drafter, draft_params, prompts, request_ids, self.max_new)

  def _generate(self, drafter, draft_params, prompts, request_ids, limit):
    kw = dict(key=self.seed, max_new_tokens=limit, request_ids=request_ids, mesh=self.mesh,
              width=self.max_new)
    if drafter is None:
      return ar.generate(self.params, self.model.cfg, prompts, sampling=self.sampling, **kw)
    return sp.generate(self.params, self.model.cfg, drafter, prompts, draft_params=draft_params,
                       spec=self.spec, **kw)


def _decode_tokens(result) -> int:
  return sum(max(len(t) - 1, 0) for t in result.tokens)


def _batch_steps(result) -> int:
  """AR decode steps of a batch: its longest row's decode tokens."""
  return max((max(len(t) - 1, 0) for t in result.tokens), default=0)


def _new_record(unit, method, repeats, settings_id, reference=False):
  rec = {"unit": unit_id(unit), "question_ids": [q.question_id for q in unit],
         "category": unit[0].category, "method": method, "settings": settings_id,
         "turns": max(len(q.turns) for q in unit), "prompt_tokens": [],
         "decode_tokens": 0, "decode_s": [0.0] * repeats, "prefill_s": [0.0] * repeats,
         "tokens": []}
  if reference:
    rec.update({"ref_ar_decode_tokens": 0, "ref_ar_decode_s": [0.0] * repeats})
  if method != "ar":
    rec.update({"ar_decode_tokens": 0, "ar_decode_s": [0.0] * repeats,
                "stats": {"rounds": 0, "emitted": 0, "proposed": 0, "accepted": 0,
                          "narrow_rounds": 0, "verified_tokens": 0},
                "identical": True})
  return rec


def _run_unit(engine: Engine, c: BenchmarkSettings, unit, methods: Sequence[str],
              ar_done: Optional[dict], settings_id: str, repeats: int, note: Callable[[str, int, int], None],
              ref_engine: Optional[Engine] = None, unit_index: int = 0):
  """AR (and the reference precision's AR) + `methods` interleaved on one unit
  (the `unit_index`-th of the run) -> records (AR's only if not done)."""
  model = engine.model
  tok, eos = model.tokenizer, model.cfg.eos_id
  recs = {m: _new_record(unit, m, repeats, settings_id, ref_engine is not None)
          for m in ["ar", *methods]}
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
      reference_first = ref_engine is not None and reference_runs_first(unit_index, t, r)
      if reference_first:
        _run_reference_ar(ref_engine, recs, methods, prompts, ids, t, r, note)
      note("ar", t, r)
      res = engine.run(None, None, prompts, ids)
      ref = ref or res.tokens
      _add(recs["ar"], r, res, res)
      for m in methods:
        recs[m]["ar_decode_s"][r] += res.decode_s
        if r == 0:
          recs[m]["ar_decode_tokens"] += _decode_tokens(res)
          # the batch's AR steps: its rows advance together until the longest is done
          recs[m]["ar_batch_steps"] = recs[m].get("ar_batch_steps", 0) + _batch_steps(res)
      if ref_engine is not None and not reference_first:
        _run_reference_ar(ref_engine, recs, methods, prompts, ids, t, r, note)
      shift = r % max(len(methods), 1)  # rotate the order across repeats
      for m in list(methods[shift:]) + list(methods[:shift]):
        if m not in built or m == "replay":
          built[m] = registry.make_drafter(m, c.drafter, model, sampling=engine.sampling,
                                           reference=ref, reference_width=engine.max_new)
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


def reference_runs_first(unit_index: int, turn: int, repeat: int) -> bool:
  """The two precisions' ARs run back to back; which one first alternates with
  the unit's place in the run, the turn and the repeat, so neither gains from
  its place in the order (whatever the batch size and the question ids)."""
  return (unit_index + turn + repeat) % 2 == 1


def uncalibrated(calib: dict, methods: Sequence[str], batch_size: int) -> List[str]:
  """The methods a run must calibrate: those without an entry, or with one of
  another batch size (an entry from before calibrations carried it is of one row)."""
  return [m for m in methods if m not in calib or calib[m].get("batch_size", 1) != batch_size]


def _run_reference_ar(ref_engine, recs, methods, prompts, ids, t, r, note):
  """AR in the reference precision: its decode time and tokens into every record."""
  note(f"ar ({ref_engine.model.cfg.dtype})", t, r)
  res = ref_engine.run(None, None, prompts, ids)
  for m in ["ar", *methods]:
    recs[m]["ref_ar_decode_s"][r] += res.decode_s
    if r == 0:
      recs[m]["ref_ar_decode_tokens"] += _decode_tokens(res)


def _divergences(engine, prompts, ref, tokens, eos, question_ids) -> List[dict]:
  """Rows whose greedy output differs from AR's: the first differing position
  and AR's top-1 minus top-2 logit gap there (teacher forced), and whether
  that is a near-tie: a gap below 10x the measured difference between a verify
  block's logits and one-token steps (`greedy_identity`)."""
  out = []
  for prompt, a, b, qid in zip(prompts, ref, tokens, question_ids):
    a, b = report.upto_eos(a, eos), report.upto_eos(b, eos)
    if a == b:
      continue
    pos = report.first_divergence(a, b)
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
    # the batch's rounds: its rows verify together until the one with the most is done
    rec["stats"]["batch_rounds"] = (rec["stats"].get("batch_rounds", 0)
                                    + res.stats["max_rounds_per_row"])
    hist = rec["stats"].get("accept_hist")
    new = res.stats["accept_hist"]
    rec["stats"]["accept_hist"] = new if hist is None else [a + b for a, b in zip(hist, new)]
    rec["identical"] = rec["identical"] and all(
        report.upto_eos(a, eos) == report.upto_eos(b, eos) for a, b in zip(res.tokens, ref))


# --- aggregation and reports --------------------------------------------------------


def summarize(records: Sequence[dict], methods: Sequence[str], meta: dict,
              calibration: Optional[dict] = None) -> List[dict]:
  """One result per method x category (plus 'all') from per-question records.

  With `calibration` ({method: {"t_verify": {n: s}, "t_draft": s}}), each row
  also carries the calibrated prediction (`predict`) and the measured seconds
  per round."""
  out = []
  cats = list(dict.fromkeys(r["category"] for r in records))
  fastest = _fastest_ar(records, meta, methods)
  for m in methods:
    mine = [r for r in records if r["method"] == m]
    for cat in cats + [ALL]:
      rs = [r for r in mine if cat in (ALL, r["category"])]
      if not rs:
        continue
      dec = [statistics.median(r["decode_s"]) for r in rs]
      ar_dec = [statistics.median(r["ar_decode_s"]) for r in rs]
      tps = report.ratio(sum(r["decode_tokens"] for r in rs), sum(dec))
      ar_tps = report.ratio(sum(r["ar_decode_tokens"] for r in rs), sum(ar_dec))
      per_q = [report.ratio(report.ratio(r["decode_tokens"], d), report.ratio(r["ar_decode_tokens"], a))
               for r, d, a in zip(rs, dec, ar_dec)]
      vs = {"fastest_ar": None, "reference_dtype": None, "reference_ar_tokens_per_s": None,
            "speedup_vs_fastest_ar": None, "speedup_vs_fastest_ar_median": None,
            "speedup_vs_fastest_ar_iqr": None}
      if fastest is not None:
        ref_dec = [statistics.median(r["ref_ar_decode_s"]) for r in rs]
        ref_tps = report.ratio(sum(r["ref_ar_decode_tokens"] for r in rs), sum(ref_dec))
        own = fastest == meta["precision"]
        vs_q = per_q if own else [
            report.ratio(report.ratio(r["decode_tokens"], d), report.ratio(r["ref_ar_decode_tokens"], a))
            for r, d, a in zip(rs, dec, ref_dec)]
        vs.update(fastest_ar=fastest, reference_dtype=meta["reference_dtype"],
                  reference_ar_tokens_per_s=ref_tps,
                  speedup_vs_fastest_ar=report.ratio(tps, ar_tps if own else ref_tps),
                  speedup_vs_fastest_ar_median=report.median(vs_q),
                  speedup_vs_fastest_ar_iqr=report.quartiles(vs_q))
      st = {k: sum(r["stats"].get(k, 0) for r in rs)
            for k in ("rounds", "emitted", "proposed", "accepted", "narrow_rounds",
                      "verified_tokens")}
      if all("batch_rounds" in r["stats"] and "ar_batch_steps" in r for r in rs):
        st.update(batch_rounds=sum(r["stats"]["batch_rounds"] for r in rs),
                  ar_batch_steps=sum(r["ar_batch_steps"] for r in rs))
      pred = (calibrate_lib.predict(st, calibration[m]) if calibration and m in calibration
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
          "speedup": report.ratio(tps, ar_tps), "speedup_iqr": report.quartiles(per_q),
          "speedup_median": report.median(per_q), **vs,
          "tau": report.ratio(st["emitted"], st["rounds"]),
          "alpha": report.ratio(st["accepted"], st["proposed"]),
          "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
          "greedy_identical": None if None in ident else all(ident),
          # rows that differ from AR, and how many of them first differ at a near-tie
          "divergent_rows": len(divs) if None not in ident else None,
          "near_tie_rows": sum(d["near_tie"] for d in divs) if None not in ident else None,
          "num_prompts": sum(len(r["question_ids"]) for r in rs),
          # per row-round; with batch_size > 1 an approximation (rows run different rounds)
          "ms_per_round": (sum(dec) / st["rounds"] * int(meta["batch_size"]) * 1e3
                           if st["rounds"] else None),
          "narrow_frac": report.ratio(st["narrow_rounds"], st["rounds"]),
          **pred,
          **{k: v for k, v in meta.items() if k not in ("checkpoints", "ks", "reference_dtype")},
          "k": (meta.get("ks") or {}).get(m, meta.get("k")),
          # guesses verified per round: k for a chain, the node count for a tree
          "verify_width": (calibration[m].get("verify_width")
                           if calibration and m in calibration else None),
          "tree": bool(tree),
          "checkpoint": (meta.get("checkpoints") or {}).get(m),
      })
  return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
           for k, v in row.items()} for row in out]


def _cast_model(model: Model, dtype: str, batch_invariant: bool) -> Model:
  """`model` with its weights cast to `dtype` (float32 -> bfloat16 rounds each
  weight as loading it in bfloat16 does), decoding batch-invariantly or not."""
  params = jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x,
                        model.params)
  cfg = model.cfg.replace(dtype=dtype, batch_invariant=batch_invariant,
                          invariant_tile=model.cfg.invariant_tile if batch_invariant else 0)
  return dataclasses.replace(model, params=params, cfg=cfg)


def _invariant(c: BenchmarkSettings, dtype: str) -> bool:
  """The run's batch_invariant setting for a model in `dtype` (unset: the precision's default)."""
  return invariant_lib.resolve(c.batch_invariant, dtype, bool(c.mesh))


def _fastest_ar(records: Sequence[dict], meta: dict,
                methods: Optional[Sequence[str]] = None) -> Optional[str]:
  """The precision whose interleaved AR had the higher decode tokens/s over
  the run (the run's own or `reference_dtype`'s; None without a reference).
  Every method's records carry the AR runs of their units, so one method's
  records decide it: the first of `methods` (else of the records) that has any."""
  if not meta.get("reference_dtype"):
    return None
  rs = [r for r in records if "ref_ar_decode_s" in r and r["method"] != "ar"]
  order = list(methods or []) + [r["method"] for r in rs]
  first = next((m for m in order if any(r["method"] == m for r in rs)), None)
  if first is None:
    return None
  rs = [r for r in rs if r["method"] == first]
  own = report.ratio(sum(r["ar_decode_tokens"] for r in rs),
                     sum(statistics.median(r["ar_decode_s"]) for r in rs))
  ref = report.ratio(sum(r["ref_ar_decode_tokens"] for r in rs),
                     sum(statistics.median(r["ref_ar_decode_s"]) for r in rs))
  if not (math.isfinite(own) and math.isfinite(ref)):
    return None
  return meta["reference_dtype"] if ref > own else meta["precision"]


# --- the run ----------------------------------------------------------------------------


def _settings(c: BenchmarkSettings) -> dict:
  out = report.config_settings(c.flat(), SETTINGS)
  out["batch_invariant"] = _invariant(c, c.dtype)  # as resolved (unset: the precision's default)
  # off / unset: records match those written before the setting existed
  for key in ("batch_invariant", "invariant_tile", "reference_dtype"):
    if not out[key]:
      del out[key]
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


def check_counts(c: BenchmarkSettings) -> None:
  """The run's counts, checked in plain Python (ConfigValueError naming the
  first out of range): the experiment mains call it before a job's processes
  start, `run_benchmark` again."""
  for name, low in (("repeats", 1), ("batch_size", 1), ("max_new_tokens", 1),
                    ("prompt_limit", 0), ("processes", 1), ("local_devices", 0)):
    value = getattr(c, name)
    if name == "prompt_limit" and value is None:  # None: every question
      continue
    require_whole(name, value, low)


def run_benchmark(c: BenchmarkSettings, model: Optional[Model] = None,
                  progress: Optional[Callable[[str], None]] = None,
                  reference_model: Optional[Model] = None) -> dict:
  """Run (or resume) the benchmark of settings `c` (`BenchmarkSettings.of`
  reads configs/benchmark.py's ConfigDict).

  `model` / `reference_model`: the run's model and its `reference_dtype`
  model, if already loaded (else loaded from `c.model`).

  Writes `c.out`/log.jsonl, results.json, results.md, speedup.png. Returns
  {"results": [...], "markdown": str, "runs": generations this call, ...}.
  """
  require(c, BenchmarkSettings, "specbench.run_benchmark")
  t_start = time.perf_counter()
  commit = report.git_commit()  # the code this process runs, before anyone commits more
  progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
  methods = report.comma_list(c.methods)
  if not methods:
    raise ConfigValueError("no methods given (e.g. methods='prompt_lookup,layer_skip')")
  if len(set(methods)) != len(methods):
    raise ConfigValueError(f"methods repeat a name: {methods}")
  for m in methods:  # fail before any work on an unknown method or a bad k
    try:
      # 'name@field=value...': the method's own fields
      base, mc = registry.method_config(m, c.drafter)
    except ValueError as e:
      raise ConfigValueError(str(e)) from e
    if base == "ar" or not registry.is_method(base):
      raise ConfigValueError(f"unknown method {m!r} (AR is always the baseline); available: "
                             f"{', '.join(registry.available_methods())} (or several joined "
                             "by '+')")
    k = mc.k
    if base not in registry.LOOKAHEAD_METHODS and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
      raise ConfigValueError(f"draft length k must be an integer >= 1, got {k!r} for {m}")
  check_counts(c)
  repeats, batch_size = c.repeats, c.batch_size
  reference = str(c.reference_dtype or "")
  own_dtype = model.cfg.dtype if model is not None else str(c.dtype)
  if reference and reference not in ("float32", "bfloat16"):
    raise ConfigValueError(f"unknown reference_dtype {reference!r}: 'float32', 'bfloat16' or "
                           "'' (none)")
  if reference and reference == own_dtype:
    raise ConfigValueError(f"reference_dtype {reference!r} is the run's own precision: the "
                           "reference AR must run in the other one")
  if reference_model is not None and reference_model.cfg.dtype != reference:
    raise ConfigValueError(f"reference_model is {reference_model.cfg.dtype}, the run's "
                           f"reference_dtype {reference!r}")
  # a given model's reference is that network itself in the reference precision (not
  # c.model reloaded, which may be another network), cast when decoding starts; exact
  # only downwards
  cast_reference = bool(reference) and reference_model is None and model is not None
  if cast_reference and reference != "bfloat16":
    raise ConfigValueError(f"reference_dtype {reference!r} beside a given {own_dtype} model: "
                           "pass reference_model (its weights cast up are not the "
                           f"{reference} weights)")
  sampling = c.sampling
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

  engine = ref_engine = None
  todo = [u for u in units if any((unit_id(u), m) not in done for m in ["ar", *methods])]
  index = {unit_id(u): i for i, u in enumerate(units)}  # a unit's place, the same when resumed
  total_q = sum(len(u) for u in units)
  q_done = total_q - sum(len(u) for u in todo)
  if distributed.multi_process():
    todo = [todo[i] for i in distributed.local_share(len(todo))]
    log_path = os.path.join(c.out, PART_LOG.format(jax.process_index()))
  t_work = time.perf_counter()
  for n, unit in enumerate(todo):
    if engine is None:
      model = model or load_model(c.model, c.dtype, batch_invariant=_invariant(c, c.dtype),
                                  invariant_tile=c.invariant_tile)
      engine = Engine(model, sampling, int(c.max_new_tokens), int(c.seed),
                      mesh=sharding.mesh_of(c.mesh))
      if reference:
        ref_inv = _invariant(c, reference)
        reference_model = reference_model or (
            _cast_model(model, reference, ref_inv) if cast_reference
            else load_model(c.model, reference, batch_invariant=ref_inv))
        ref_engine = Engine(reference_model, sampling, int(c.max_new_tokens), int(c.seed),
                            mesh=sharding.mesh_of(c.mesh))
    missing = [m for m in methods if (unit_id(unit), m) not in done]
    eta = ("?" if n == 0 else
           report.clock((time.perf_counter() - t_work) / n * (len(todo) - n)))

    def note(m, t, r, unit=unit, eta=eta):
      progress(f"[{q_done}/{total_q} prompts] {unit[0].category} q{unit_id(unit)} "
               f"turn {t + 1} {m} repeat {r + 1}/{repeats} | elapsed "
               f"{report.clock(time.perf_counter() - t_start)}, ETA {eta}")

    recs = _run_unit(engine, c, unit, missing, done.get((unit_id(unit), "ar")), settings_id,
                     repeats, note, ref_engine, unit_index=index[unit_id(unit)])
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
      "temperature": sampling.temperature, "batch_size": batch_size, "k": c.drafter.k,
      "top_k": sampling.top_k, "top_p": sampling.top_p,
      "precision": engine.model.cfg.dtype if engine else str(c.dtype),
      "reference_dtype": reference or None,
      "seed": int(c.seed), "max_new_tokens": int(c.max_new_tokens),
      "checkpoints": {m: registry.drafter_id(m, c.drafter, engine.model if engine else None)
                      for m in methods},
      "ks": {m: registry.method_config(m, c.drafter)[1].k for m in methods},
      "commit": commit, "hardware": report.hardware(),
  }
  calib = None
  calib_path = os.path.join(c.out, "calibration.json")
  primary = distributed.is_primary()
  if c.calibrate and units:
    # Measured once per run directory (a resumed run reuses it; delete the file
    # to measure again); by process 0 in a multi-process run.
    calib = calibrate_lib.read_calibration(calib_path)
    missing = uncalibrated(calib, methods, int(c.batch_size))
    if missing and primary:
      model = model or (engine.model if engine else load_model(
          c.model, c.dtype, batch_invariant=_invariant(c, c.dtype),
          invariant_tile=c.invariant_tile))
      progress("calibrating: forward cost t_verify(n) and each drafter's proposal cost")
      calib.update(calibrate_lib.calibrate(model, c.drafter, missing, units[0], sampling,
                                           int(c.max_new_tokens), int(c.batch_size)))
      with open(calib_path, "w") as f:
        json.dump(calib, f, indent=1)
    distributed.barrier("bench/calibrated")
    if not primary:
      calib = calibrate_lib.read_calibration(calib_path)
  results = summarize(records, methods, meta, calib)
  extra = {"repeats": repeats, "runtime_s": round(time.perf_counter() - t_start, 1),
           "compile_s": round(sum(e.compile_s for e in (engine, ref_engine) if e), 1),
           "timed_runs_this_call": sum(e.runs for e in (engine, ref_engine) if e)}
  md = specbench_report.format_markdown(results, extra)
  if primary:
    with open(os.path.join(c.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
    with open(os.path.join(c.out, "results.md"), "w") as f:
      f.write(md)
    specbench_report.plot_speedup(results, os.path.join(c.out, "speedup.png"))
  return {"results": results, "markdown": md, "runs": extra["timed_runs_this_call"],
          "runtime_s": extra["runtime_s"], "compile_s": extra["compile_s"]}
