"""Batch-invariant decoding (`ModelConfig.batch_invariant`): what it costs and
what it buys.

Cost, side by side in one process, each precision, the default forward and
the invariant one at each tile of `tiles` interleaved over repeats (so all see
the same machine load):

  AR tok/s       greedy B = 1 decode of `max_new_tokens` tokens (prefill apart)
  t_verify(k+1)  one chain verify forward of k + 1 tokens per row after the
                 prompt, at each batch size of `verify_batches`, median
                 over `verify_calls` calls
  at context L   for each L of `verify_contexts`, B = 1: t_verify(1) (an AR
                 step, or a narrow verify) and t_verify(k + 1) after L context
                 tokens (attention reads the whole cache: Spec-Bench's
                 summarization and RAG prompts run to ~1,300 tokens, where the
                 invariant forward's tile-wide attention costs most)

What it buys: with the setting on, greedy speculative decoding must equal
greedy AR token for token, no near-tie allowance. For each precision and each
method, the first `prompt_limit` Spec-Bench questions of every category (by
question_id) are answered by AR and by the method, `batch_size` questions
decoded together, and every output is compared with AR's exactly; the
default mode runs beside it as the control (divergences expected). Each
result is logged as it finishes (`out`/identity.jsonl) and a restarted run
goes on from there: the full run is hours on a 2-core CPU.

What it keeps of the speedup (part `speedup`): each of `speedup_methods`
(the headline's best methods) at B = 1 on the first `speedup_limit`
Spec-Bench questions per category, in every precision of
`speedup_method_dtypes` (default: `dtypes`) with the default forward and with
the invariant one at each tile of `tiles`, each question also decoded by AR
with each precision of `dtypes`' default forward and with each invariant
tile in the methods' precisions -- all interleaved per question, the order
rotating, compiles excluded. Per question: speedup = the method's decode
tokens/s over AR's, against the precision's default AR and against the
fastest AR of any mode (precision x forward, the highest median tokens/s);
per method and mode: the medians [IQR] (and per category against the
fastest AR), the drop against
the same method's default forward, and issue 20's reading, the drop against
the best default-forward row (any method) over the fastest AR (the goal:
<= 10% for the best invariant row); per AR mode: its tokens/s against the
fastest AR's (the setting becomes a precision's default where its invariant
AR is within 5%).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.analysis import bitwise
from specjax.benchmarks import questions as questions_lib
from specjax.benchmarks import report
from specjax.benchmarks import specbench
from specjax.checks import require_whole, require_whole_list
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.settings import DrafterSettings
from specjax.errors import ConfigValueError
from specjax.io import jsonl
from specjax.io.load import load_model
from specjax.models.config import MAX_INVARIANT_TILE
from specjax.models import cache as cache_lib
from specjax.models import invariant as invariant_lib
from specjax.models import transformer
from specjax.settings import RunSettings, require


@dataclasses.dataclass(frozen=True)
class InvarianceSettings(RunSettings):
  """A batch-invariance run (`experiments/invariance.py`, configs/invariance.py)."""

  model: str = "smollm2-135m"
  dtypes: str = "float32,bfloat16"
  # or "report": the identity table from `out`/identity.jsonl, nothing run; "bitwise":
  # verify blocks vs one-token steps bit for bit on `model` at each tile of `tiles`
  # (and the default forward, the control): specjax.analysis.bitwise
  parts: str = "cost,identity"
  # cost
  prompt: str = "Write a long story about a lighthouse keeper who finds a message in a bottle."
  max_new_tokens: int = 64
  repeats: int = 4
  verify_calls: int = 20
  verify_batches: str = "1,4"  # t_verify(k + 1) at these batch sizes
  verify_contexts: str = "512,1280"  # and B = 1 t_verify(1), t_verify(k + 1) after L tokens
  # cost, bitwise and speedup: the invariant forward at these rows per tile
  # (ModelConfig.invariant_tile; 0: the precision's default), beside the default forward
  tiles: str = "0"
  # identity: every drafter, chains and trees, on the headline prompt set
  prompts: str = questions_lib.SPEC_BENCH  # the Spec-Bench questions (without MT-Bench)
  prompt_limit: int = 10  # the first N questions of each category
  batch_size: int = 10
  modes: str = "on,off"  # batch_invariant on (the claim), off (what the default forward does)
  identity_tile: int = 0  # the 'on' mode's rows per tile (0: the precision's default)
  # speedup: methods (name@field=value..., comma-separated) in the precisions of
  # speedup_method_dtypes ('': every one of dtypes; AR runs in every one of dtypes),
  # the first N questions per category
  speedup_methods: str = "prompt_lookup@k=3"
  speedup_method_dtypes: str = ""
  speedup_limit: int = 10
  speedup_tokens: int = 96
  methods: str = ("prompt_lookup,layer_skip,draft_model,medusa,blockwise,eagle,eagle3,lookahead,"
                  "replay,medusa_tree,eagle_tree,eagle3_tree,lookahead_tree")
  out: str = ""  # the identity log, results.json and results.md go here ('': none)
  # the drafters' settings (k: their draft length, and the cost part's verify block
  # of k + 1 tokens)
  drafter: DrafterSettings = DrafterSettings()


_VERIFY_SLACK = 128  # cache slots past a timed block's context


def _verify_timer(model, k: int, prompt_len: int, calls: int,
                  batch: int = 1) -> Callable[[], float]:
  cfg = model.cfg
  fwd = jax.jit(transformer.forward, static_argnames=("cfg", "batch_invariant"))
  cache = cache_lib.init_cache(cfg, batch, cache_lib.round_up(prompt_len + _VERIFY_SLACK, 16))
  prompt = jnp.full((batch, prompt_len), 100, jnp.int32)
  _, _, cache = fwd(model.params, cfg, prompt, transformer.chain_positions(cache, prompt_len),
                    cache, batch_invariant=False)
  block = jnp.full((batch, k + 1), 200, jnp.int32)
  pos = transformer.chain_positions(cache, k + 1)
  fwd(model.params, cfg, block, pos, cache)[0].block_until_ready()

  def once() -> float:
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      fwd(model.params, cfg, block, pos, cache)[0].block_until_ready()
      times.append(time.perf_counter() - t0)
    return statistics.median(times)

  return once


def cost(c: InvarianceSettings, progress: Callable[[str], None]) -> List[dict]:
  """AR tok/s and t_verify(k + 1) of the default forward and of the invariant one
  at each tile of `tiles`, per precision (the module docstring)."""
  require(c, InvarianceSettings, "invariance.cost")
  rows = []
  modes = [None] + _tiles(c)  # None: the default forward; else the invariant one's tile
  for dtype in report.comma_list(c.dtypes):
    models = {m: load_model(c.model, dtype, batch_invariant=m is not None,
                            invariant_tile=m or 0) for m in modes}
    prompt = models[None].tokenizer.encode_prompt(c.prompt)
    batches = _batches(c)
    timers = {(m, b): _verify_timer(model, c.drafter.k, len(prompt), c.verify_calls, b)
              for m, model in models.items() for b in batches}
    room = models[None].cfg.max_seq_len - _VERIFY_SLACK
    if any(ctx > room for ctx in _contexts(c)):
      raise ConfigValueError(f"verify_contexts {c.verify_contexts!r}: {c.model} holds at most "
                             f"{room} context tokens before a timed block")
    # (mode, context, width) at B = 1: a width-w block after `context` tokens
    timers.update({(m, (ctx, w)): _verify_timer(model, w - 1, ctx, c.verify_calls)
                   for m, model in models.items() for ctx in _contexts(c)
                   for w in (1, c.drafter.k + 1)})
    for model in models.values():  # compile (every run decodes max_new_tokens: no EOS)
      ar.generate(model.params, model.cfg.replace(eos_id=-1), [prompt],
                  max_new_tokens=c.max_new_tokens)
    tps = {m: [] for m in modes}
    tv = {key: [] for key in timers}
    for r in range(c.repeats):
      for m in modes if r % 2 == 0 else modes[::-1]:
        model = models[m]
        res = ar.generate(model.params, model.cfg.replace(eos_id=-1), [prompt],
                          max_new_tokens=c.max_new_tokens)
        tps[m].append((res.num_new_tokens - 1) / res.decode_s)
        for key in [key for key in timers if key[0] == m]:
          tv[key].append(timers[key]())
      progress(f"{dtype} repeat {r + 1}/{c.repeats}")
    for m in modes:
      row = {"dtype": dtype, "batch_invariant": m is not None,
             "invariant_tile": None if m is None else invariant_lib.tile_rows(dtype, m),
             "ar_tokens_per_s": statistics.median(tps[m]),
             "ar_ratio": statistics.median(tps[m]) / statistics.median(tps[None])}
      for b in batches:
        t, t0 = statistics.median(tv[(m, b)]), statistics.median(tv[(None, b)])
        row[f"t_verify_B{b}_ms"], row[f"t_verify_B{b}_ratio"] = 1e3 * t, t / t0
      for ctx in _contexts(c):
        for w in (1, c.drafter.k + 1):
          t, t0 = statistics.median(tv[(m, (ctx, w))]), statistics.median(tv[(None, (ctx, w))])
          row[f"t_L{ctx}_w{w}_ms"], row[f"t_L{ctx}_w{w}_ratio"] = 1e3 * t, t / t0
      rows.append(row)
  return rows


def speedup(c: InvarianceSettings, progress: Callable[[str], None]) -> List[dict]:
  """Each of `speedup_methods`' speedup over AR with the default forward and
  with the invariant one at each tile of `tiles` (0: the precision's default;
  a tile named twice runs once), in every precision of `speedup_method_dtypes`
  (default: `dtypes`); AR with the default forward in every precision of
  `dtypes` and with each invariant tile in the methods' precisions; all
  interleaved per question (the module docstring). A row per method and mode:
  against the method's precision's default AR, and against the fastest AR of
  any mode (precision x forward). After them a row per AR mode (method 'ar':
  dtype, tile, `ar_tok_s_median` and the `vs_fastest_ar` fields only)."""
  require(c, InvarianceSettings, "invariance.speedup")
  questions = sorted(questions_lib.load_questions(c.prompts, c.speedup_limit),
                     key=lambda q: (q.category, q.question_id))
  dtypes, methods = report.comma_list(c.dtypes), report.comma_list(c.speedup_methods)
  method_dtypes = report.comma_list(c.speedup_method_dtypes) or dtypes
  if not methods:
    raise ConfigValueError("speedup_methods is empty: name at least one method")
  if set(method_dtypes) - set(dtypes):
    raise ConfigValueError(f"speedup_method_dtypes {c.speedup_method_dtypes!r} must be among "
                           f"dtypes {c.dtypes!r} (a method is measured against its own "
                           "precision's AR)")
  # per precision: None (the default forward), then each invariant tile's rows once
  modes = {d: [None] + list(dict.fromkeys(invariant_lib.tile_rows(d, t) for t in _tiles(c)))
           if d in method_dtypes else [None] for d in dtypes}
  engines = {(d, m): specbench.Engine(load_model(c.model, d, batch_invariant=m is not None,
                                                 invariant_tile=m or 0),
                                      sampling_lib.GREEDY, c.speedup_tokens, 0)
             for d in dtypes for m in modes[d]}
  built = {(d, m, name): registry.make_drafter(name, c.drafter, engines[(d, m)].model,
                                               sampling=sampling_lib.GREEDY)
           for d in method_dtypes for m in modes[d] for name in methods}
  runs = [("ar", d, m, None) for d, m in engines] + [("spec", *key) for key in built]
  speeds = {r: [] for r in runs}  # decode tokens/s per question
  tokenizer = engines[(dtypes[0], None)].model.tokenizer
  for n, q in enumerate(questions):
    prompt = tokenizer.encode_prompt(q.turns[0])
    shift = n % len(runs)  # the order rotates: no mode always runs first
    for kind, d, m, name in runs[shift:] + runs[:shift]:
      e = engines[(d, m)]
      res = e.run(None, None, [prompt], [q.question_id]) if kind == "ar" else \
          e.run(*built[(d, m, name)], [prompt], [q.question_id])
      speeds[(kind, d, m, name)].append(specbench._decode_tokens(res) / max(res.decode_s, 1e-9))  # pylint: disable=protected-access
    progress(f"{q.category} q{q.question_id} ({n + 1}/{len(questions)}): " + ", ".join(
        f"{name} {_mode_name(d, m)} "
        f"{speeds[('spec', d, m, name)][-1] / speeds[('ar', d, None, None)][-1]:.2f}x"
        for d, m, name in built))
  # the fastest AR: the mode (precision x forward) with the highest median tokens/s
  fastest = max(engines, key=lambda dm: report.median(speeds[("ar", *dm, None)]))
  base = speeds[("ar", *fastest, None)]
  rows = []

  def mode_row(d, m, name, ar_key, cross):
    return {"dtype": d, "batch_invariant": m is not None, "invariant_tile": m, "method": name,
            "questions": len(cross), "ar_tok_s_median": report.median(speeds[ar_key]),
            "fastest_ar": _mode_name(*fastest), "vs_fastest_ar_median": report.median(cross),
            "vs_fastest_ar_iqr": report.quartiles(cross), "vs_fastest_ar": cross}

  for d, m, name in built:
    ar = speeds[("ar", d, None, None)]
    own = _ratios(speeds[("spec", d, m, name)], ar)
    med = report.median(own)
    default = report.median(_ratios(speeds[("spec", d, None, name)], ar))
    cross = _ratios(speeds[("spec", d, m, name)], base)
    rows.append({**mode_row(d, m, name, ("ar", d, None, None), cross),
                 "speedup_median": med, "speedup_iqr": report.quartiles(own), "speedups": own,
                 "drop_vs_default": 1.0 - med / default,
                 "categories": _by_category(questions, cross)})
  # issue 20's reading: each mode against the best default-forward row (any
  # method, any precision), both over the fastest AR of any mode
  best_default = max(r["vs_fastest_ar_median"] for r in rows if not r["batch_invariant"])
  for r in rows:
    r["drop_vs_best_default"] = 1.0 - r["vs_fastest_ar_median"] / best_default
  for d, m in engines:  # each AR mode against the fastest (the setting's default rule)
    rows.append(mode_row(d, m, "ar", ("ar", d, m, None), _ratios(speeds[("ar", d, m, None)], base)))
  return rows


def _ratios(xs, ys) -> List[float]:
  return [x / y for x, y in zip(xs, ys)]


def _mode_name(dtype: str, tile: Optional[int]) -> str:
  """'float32' for the default forward, 'bfloat16 invariant 5' for a tile of 5 rows."""
  return dtype if tile is None else f"{dtype} invariant {tile}"


def _by_category(questions, ratios) -> Dict[str, float]:
  """Median ratio per Spec-Bench category."""
  cats = {}
  for q, x in zip(questions, ratios):
    cats.setdefault(q.category, []).append(x)
  return {cat: report.median(xs) for cat, xs in cats.items()}


def bitwise_check(c: InvarianceSettings, progress: Callable[[str], None]) -> List[dict]:
  """Per precision and tile of `tiles` (and the default forward, which should
  mismatch): the chain widths (`bitwise.FEW_WIDTHS`) and tree nodes whose
  verify logits differ from one-token steps on `model`, a ragged B = 4."""
  require(c, InvarianceSettings, "invariance.bitwise_check")
  rows = []
  for dtype in report.comma_list(c.dtypes):
    model = load_model(c.model, dtype)
    for tile in [None] + _tiles(c):  # None: the default forward
      cfg = model.cfg.replace(batch_invariant=tile is not None, invariant_tile=tile or 0)
      chain = bitwise.chain_mismatches(model.params, cfg, bitwise.RAGGED, bitwise.FEW_WIDTHS)
      tree = bitwise.tree_mismatches(model.params, cfg, bitwise.RAGGED)
      rows.append({"dtype": dtype, "batch_invariant": tile is not None,
                   "invariant_tile": None if tile is None else invariant_lib.tile_rows(dtype, tile),
                   "widths": list(bitwise.FEW_WIDTHS), "tree_nodes": len(bitwise.PARENT),
                   "chain_mismatches": chain, "tree_mismatches": tree})
      progress(f"{dtype} tile {rows[-1]['invariant_tile'] or '-'}: {len(chain)} widths and "
               f"{len(tree)} tree nodes differ")
  return rows


def _unit_key(dtype: str, inv: bool, method: str, ids) -> tuple:
  return (dtype, bool(inv), method, tuple(ids))


def _log_settings(c: InvarianceSettings) -> dict:
  """The settings each identity record carries, that a resumed log must match:
  model, max_new_tokens, k, batch_size, the invariant forward's formulation
  (`invariant_lib.formulation()`: a log of another formulation is refused, its bits
  are another forward's), plus identity_tile and the drafter fields other than
  k when set away from their defaults."""
  flat = c.flat()
  out = {"model": flat["model"], "max_new_tokens": int(flat["max_new_tokens"]),
         "k": int(flat["k"]), "batch_size": int(flat["batch_size"]),
         "invariant_forward": invariant_lib.formulation()}
  default = dataclasses.asdict(DrafterSettings())
  out.update({name: value for name, value in dataclasses.asdict(c.drafter).items()
              if name != "k" and value != default[name]})
  if int(flat["identity_tile"]):
    out["identity_tile"] = int(flat["identity_tile"])
  return out


def identity(c: InvarianceSettings, progress: Callable[[str], None],
             run: bool = True) -> List[dict]:
  """Greedy speculative vs greedy AR, token for token, per precision, mode and
  method. With `c.out`, every (precision, mode, method, batch of questions)
  result is appended to `c.out`/identity.jsonl as it finishes and a restarted
  run skips what the log holds (a run that settings change must use another
  `out`). `run=False` runs nothing: the rows count what the log holds so far
  (a partial run's table)."""
  require(c, InvarianceSettings, "invariance.identity")
  questions = questions_lib.load_questions(c.prompts, c.prompt_limit)
  by_cat: Dict[str, list] = {}
  for q in sorted(questions, key=lambda q: q.question_id):
    by_cat.setdefault(q.category, []).append(q)
  units = [qs[i:i + c.batch_size] for _, qs in sorted(by_cat.items())
           for i in range(0, len(qs), c.batch_size)]
  methods = report.comma_list(c.methods)
  settings = _log_settings(c)
  log = os.path.join(c.out, "identity.jsonl") if c.out else None
  if log:
    os.makedirs(c.out, exist_ok=True)
  done = {}
  for rec in jsonl.read(log) if log else []:
    if rec.get("settings") != settings:
      raise ConfigValueError(f"{log} holds results for other settings ({rec.get('settings')}, "
                             f"this run: {settings}): use another out directory")
    done[_unit_key(rec["dtype"], rec["batch_invariant"], rec["method"],
                   rec["question_ids"])] = rec
  if done:
    progress(f"{len(done)} results from {log}")
  rows = []
  for dtype in report.comma_list(c.dtypes):
    for inv in _modes(c):
      model = None
      for n, unit in enumerate(units if run else ()):
        ids = [q.question_id for q in unit]
        todo = [m for m in methods if _unit_key(dtype, inv, m, ids) not in done]
        if not todo:
          continue
        model = model or load_model(c.model, dtype, batch_invariant=inv,
                                    invariant_tile=c.identity_tile if inv else 0)
        prompts = [model.tokenizer.encode_prompt(q.turns[0]) for q in unit]
        # one prompt forward per distinct (cache size, hidden layers), shared
        # by AR and every method: long prompts' prefill dominated a unit
        forwards = ar.PromptForwards()
        ref = ar.generate(model.params, model.cfg, prompts, max_new_tokens=c.max_new_tokens,
                          prompt_forwards=forwards).tokens
        for m in todo:
          drafter, dparams = registry.make_drafter(
              m, c.drafter, model, sampling=sampling_lib.GREEDY, reference=ref,
              reference_width=c.max_new_tokens)
          got = sp.generate(model.params, model.cfg, drafter, prompts, draft_params=dparams,
                            max_new_tokens=c.max_new_tokens, prompt_forwards=forwards).tokens
          rec = {"settings": settings, "dtype": dtype, "batch_invariant": inv, "method": m,
                 "question_ids": ids, "identical": [a == b for a, b in zip(ref, got)],
                 "first_divergence": [report.first_divergence(a, b)
                                      for a, b in zip(ref, got)]}
          if log:
            jsonl.append(log, [rec])
          done[_unit_key(dtype, inv, m, ids)] = rec
        progress(f"{dtype} invariant={inv} {unit[0].category} batch {n + 1}/{len(units)}")
      for m in methods:
        counts = {"rows": 0, "identical": 0, "first_divergence": []}
        for unit in units:
          rec = done.get(_unit_key(dtype, inv, m, [q.question_id for q in unit]))
          if rec is None:  # only without `run`: not in the log yet
            continue
          for qid, same, pos in zip(rec["question_ids"], rec["identical"],
                                    rec["first_divergence"]):
            counts["rows"] += 1
            counts["identical"] += int(same)
            if not same:
              counts["first_divergence"].append((qid, pos))
        if counts["rows"]:
          rows.append({"dtype": dtype, "batch_invariant": inv, "method": m, **counts})
  return rows


def _modes(c: InvarianceSettings) -> List[bool]:
  """The identity part's modes: 'on' (batch_invariant), 'off' (the default forward)."""
  names = report.comma_list(c.modes)
  unknown = set(names) - {"on", "off"}
  if unknown or not names:
    raise ValueError(f"modes must be a comma-separated subset of 'on,off', got {c.modes!r}")
  return [m == "on" for m in names]


def _tiles(c: InvarianceSettings) -> List[int]:
  """The cost part's invariant tiles (0: the precision's default), distinct."""
  return require_whole_list("tiles", c.tiles, 0, MAX_INVARIANT_TILE,
                            why="0: the precision's default, else rows", distinct=True)


def _batches(c: InvarianceSettings) -> List[int]:
  """The cost part's batch sizes for t_verify(k + 1), distinct, each >= 1."""
  return require_whole_list("verify_batches", c.verify_batches, 1,
                            why="the cost part's verify batch sizes", distinct=True)


def _contexts(c: InvarianceSettings) -> List[int]:
  """The cost part's context lengths for B = 1 verify timings, each >= 1."""
  error = ConfigValueError(f"verify_contexts must be comma-separated token counts >= 1 "
                           f"('' for none), got {c.verify_contexts!r}")
  try:
    ctxs = list(dict.fromkeys(int(x) for x in str(c.verify_contexts).split(",") if x.strip()))
  except ValueError:
    raise error from None
  if any(x < 1 for x in ctxs):
    raise error
  return ctxs


def markdown(cost_rows: Optional[List[dict]], identity_rows: Optional[List[dict]],
             c: InvarianceSettings, bitwise_rows: Optional[List[dict]] = None,
             speedup_rows: Optional[List[dict]] = None) -> str:
  out = []
  if speedup_rows:
    fastest = speedup_rows[0].get("fastest_ar")
    cats = list(next((r for r in speedup_rows if r["method"] != "ar"), {}).get("categories") or {})
    out += [f"Speedup with the default forward and the invariant one ({c.model}, greedy, "
            f"B = 1, {c.speedup_tokens} new tokens, the first {c.speedup_limit} Spec-Bench "
            "questions per category, every mode of every precision interleaved per question; "
            "decode tokens/s ratios, median [IQR] over questions): against the precision's own "
            f"AR with the default forward, and against the fastest AR of any mode "
            f"({fastest}; the drop there is against the best default-forward row, "
            "any method; per category: medians against the fastest AR):", "",
            "| method | dtype | batch_invariant | tile | questions | AR tok/s | speedup (own AR) | "
            "drop vs default | vs fastest AR | drop vs best default | "
            + "".join(f"{cat} | " for cat in cats),
            "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(cats)]
    for r in (r for r in speedup_rows if r["method"] != "ar"):
      q1, q3 = r["speedup_iqr"]
      f1, f3 = r["vs_fastest_ar_iqr"]
      out.append(f"| {r['method']} | {r['dtype']} | {r['batch_invariant']} | "
                 f"{r['invariant_tile'] or '-'} | {r['questions']} | "
                 f"{r['ar_tok_s_median']:.1f} | "
                 f"{r['speedup_median']:.2f}x [{q1:.2f}-{q3:.2f}] | "
                 f"{100 * r['drop_vs_default']:.1f}% | "
                 f"{r['vs_fastest_ar_median']:.2f}x [{f1:.2f}-{f3:.2f}] | "
                 f"{100 * r['drop_vs_best_default']:.1f}% | "
                 + "".join(f"{r['categories'][cat]:.2f}x | " for cat in cats))
    out += ["", "AR in each mode (the same questions, interleaved): median tokens/s and the "
            "median per-question ratio to the fastest AR's:", "",
            "| dtype | batch_invariant | tile | AR tok/s | vs fastest AR |", "|---|---|---|---|---|"]
    for r in (r for r in speedup_rows if r["method"] == "ar"):
      f1, f3 = r["vs_fastest_ar_iqr"]
      out.append(f"| {r['dtype']} | {r['batch_invariant']} | {r['invariant_tile'] or '-'} | "
                 f"{r['ar_tok_s_median']:.1f} | "
                 f"{r['vs_fastest_ar_median']:.2f}x [{f1:.2f}-{f3:.2f}] |")
    out.append("")
  if bitwise_rows:
    out += [f"Verify blocks vs one-token steps, bit for bit ({c.model}, ragged B = 4 at "
            f"lengths {list(bitwise.RAGGED)}, chain widths {list(bitwise.FEW_WIDTHS)}, a tree "
            f"of {len(bitwise.PARENT)} nodes; the default forward is the control):", "",
            "| dtype | batch_invariant | tile | chain widths that differ (max abs diff) | "
            "tree nodes that differ |", "|---|---|---|---|---|"]
    for r in bitwise_rows:
      chain = ", ".join(f"{w} ({d:.1e})" for w, d in r["chain_mismatches"]) or "none"
      out.append(f"| {r['dtype']} | {r['batch_invariant']} | {r['invariant_tile'] or '-'} | "
                 f"{chain} | {len(r['tree_mismatches'])} of {r['tree_nodes'] + 1} |")
    out.append("")
  if cost_rows:
    out += ["Cost of batch invariance (SmolLM2-135M, greedy; the modes "
            f"interleaved, {c.repeats} repeats, medians; k = {c.drafter.k}; tile: the "
            "invariant forward's rows per tile).", "",
            "| dtype | batch_invariant | tile | AR tok/s (B = 1) | vs default | "
            + " | ".join(f"t_verify(k+1) B = {b} ms | vs default" for b in _batches(c)) + " |",
            "|---|---|---|---|---|" + "---|---|" * len(_batches(c))]
    for r in cost_rows:
      tile = r.get("invariant_tile") or "-"
      out.append(f"| {r['dtype']} | {r['batch_invariant']} | {tile} | "
                 f"{r['ar_tokens_per_s']:.1f} | "
                 f"{r['ar_ratio']:.2f}x | " + " | ".join(
                     f"{r[f't_verify_B{b}_ms']:.1f} | {r[f't_verify_B{b}_ratio']:.2f}x"
                     for b in _batches(c)) + " |")
    if _contexts(c):
      k1 = c.drafter.k + 1
      out += ["", f"B = 1 after L context tokens: t_verify(1) (an AR step or a narrow verify) "
              f"and t_verify({k1}), ms, and against the default forward's.", "",
              "| dtype | batch_invariant | tile | " + " | ".join(
                  f"L = {x}: t(1) | vs default | t({k1}) | vs default" for x in _contexts(c))
              + " |", "|---|---|---|" + "---|---|---|---|" * len(_contexts(c))]
      for r in cost_rows:
        out.append(f"| {r['dtype']} | {r['batch_invariant']} | "
                   f"{r.get('invariant_tile') or '-'} | " + " | ".join(
                       f"{r[f't_L{x}_w{w}_ms']:.1f} | {r[f't_L{x}_w{w}_ratio']:.2f}x"
                       for x in _contexts(c) for w in (1, k1)) + " |")
  if identity_rows:
    out += ["", f"Greedy speculative output vs greedy AR, token for token ({c.max_new_tokens} "
            f"new tokens, the first {c.prompt_limit} Spec-Bench questions per category, "
            f"batch {c.batch_size}, k = {c.drafter.k}):", "",
            "| dtype | batch_invariant | method | identical rows | first divergences "
            "(question, position) |", "|---|---|---|---|---|"]
    for r in identity_rows:
      div = ", ".join(f"{q}@{p}" for q, p in r["first_divergence"][:6])
      more = len(r["first_divergence"]) - 6
      out.append(f"| {r['dtype']} | {r['batch_invariant']} | {r['method']} | "
                 f"{r['identical']}/{r['rows']} | {div}{f' (+{more})' if more > 0 else ''} |")
  return "\n".join(out) + "\n"


def run(c: InvarianceSettings, progress: Optional[Callable[[str], None]] = None) -> Dict:
  """The parts of settings `c` (`InvarianceSettings.of(config)` reads
  configs/invariance.py's ConfigDict) -> {"cost", "identity", "markdown"}."""
  require(c, InvarianceSettings, "invariance.run")
  progress = progress or (lambda s: print(s, flush=True))
  parts = [p for p in c.parts.split(",") if p]
  unknown = set(parts) - {"cost", "identity", "report", "bitwise", "speedup"}
  if unknown or not parts:
    raise ConfigValueError(f"parts must be a comma-separated subset of "
                           f"'cost,identity,report,bitwise,speedup', got {c.parts!r}")
  if "report" in parts and not c.out:
    raise ConfigValueError("parts=report renders `out`/identity.jsonl: set out")
  for name, low in (("max_new_tokens", 1), ("repeats", 1), ("verify_calls", 1),
                    ("prompt_limit", 0), ("batch_size", 1), ("identity_tile", 0),
                    ("speedup_limit", 0), ("speedup_tokens", 1)):
    require_whole(name, getattr(c, name), low)
  if "cost" in parts:
    _contexts(c)  # a malformed list fails before any model loads
    _batches(c)
  bitwise_rows = bitwise_check(c, progress) if "bitwise" in parts else None
  speedup_rows = speedup(c, progress) if "speedup" in parts else None
  cost_rows = cost(c, progress) if "cost" in parts else None
  identity_rows = (identity(c, progress) if "identity" in parts else
                   identity(c, progress, run=False) if "report" in parts else None)
  return {"cost": cost_rows, "identity": identity_rows, "bitwise": bitwise_rows,
          "speedup": speedup_rows,
          "markdown": markdown(cost_rows, identity_rows, c, bitwise_rows, speedup_rows)}
