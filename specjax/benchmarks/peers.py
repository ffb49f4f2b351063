"""specjax side by side with other implementations on the same prompts and weights.

Systems, all greedy, batch of one, in one process:

  specjax      AR; draft_model@k (the same draft model as HF's assistant, full
               vocabulary); prompt_lookup@k (the same k and n-gram, min n-gram 1);
               the configured best method (`best`)
  HF           transformers `generate`: AR; assisted generation with the draft
               model exported to an HF directory (k guesses, constant
               schedule); prompt lookup (k, max n-gram)   [`peers` extra]
  llama.cpp    llama-cpp-python on the GGUF's own quantized kernels: AR;
               prompt lookup (k, max n-gram)               [`llamacpp` extra;
               skipped, with a row saying so, when not installed]

Protocol (as `specbench`, whose question loading, chat template and specjax
engine it reuses):

* Spec-Bench JSONL questions, `prompt_limit` per category, through the chat
  template; a later turn of a multi-turn question carries specjax AR's answers
  to the earlier turns, so every system sees the same prompt ids.
* Per question and turn, every system runs `repeats` times, interleaved (the
  order rotated each repeat), so all see the same machine load. A system's
  decode time for a question is summed over its turns; the median over
  repeats enters the table.
* Warm-up excluded: specjax compiles each (method, shape) untimed first
  (`specbench.Engine`); each peer mode generates once untimed before the
  first timed run.
* Decode only: tokens after the first new ones over the time after them;
  prefill reported apart.

Table (`peers_report`), per system and mode over all questions:

  tokens_per_s   total decode tokens / total median decode time
  vs own AR      tokens_per_s / the same system's AR tokens_per_s (like for like)
  vs HF AR       tokens_per_s / HF AR's tokens_per_s
  identical      every output equals the same system's own AR output up to EOS

The closing note compares specjax's fastest row with each peer's fastest row.
Every finished question is appended to `out`/log.jsonl; a restart with the
same settings skips the questions there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import jax

from specjax import sampling as sampling_lib
from specjax.benchmarks import ar as ar_bench
from specjax.benchmarks import peers_report
from specjax.benchmarks import questions as questions_lib
from specjax.benchmarks import report
from specjax.benchmarks import specbench
from specjax.checks import require_whole
from specjax.drafters import registry
from specjax.drafters.settings import DrafterSettings
from specjax.io.load import Model, load_model
from specjax.peers import hf, llamacpp
from specjax.settings import RunSettings, require

SPECJAX, HF, LLAMACPP = peers_report.SPECJAX, peers_report.HF, peers_report.LLAMACPP
LOG = "log.jsonl"
# Settings that change a record's numbers; a resumed log must match them.
SETTINGS = ("model", "dtype", "hf_dtype", "max_new_tokens", "k", "lookup_k", "max_ngram",
            "draft_model", "hf_draft", "best", "repeats", "threads", "hf", "llamacpp",
            "llamacpp_ctx")


@dataclasses.dataclass(frozen=True)
class PeersSettings(RunSettings):
  """A side-by-side run (`experiments/peers.py`, configs/peers.py); all greedy."""

  model: str = "smollm2-135m"  # a model name, GGUF file or HF directory
  tokenizer_from: str = ""  # for an HF directory: the model name / GGUF holding the tokenizer
  dtype: str = "bfloat16"  # specjax's precision (its faster setting here)
  hf_dtype: str = "float32"  # the HF peer's (the GGUF dequantized by transformers)
  prompts: str = questions_lib.SPEC_BENCH  # any JSONL file in Spec-Bench's format
  prompt_limit: int = 2  # questions per category (0: all)
  max_new_tokens: int = 128
  repeats: int = 3  # timed runs per system and question, interleaved; the median counts
  threads: int = 0  # torch / llama.cpp threads (0: all CPU cores)
  hf: bool = hf.available()  # the HF transformers peer (the `peers` extra)
  llamacpp: bool = True  # the llama.cpp peer, when llama-cpp-python is installed
  llamacpp_ctx: int = 4096  # llama.cpp context (prompt + new tokens + guesses)
  # Like for like: specjax's draft_model and HF's assistant draft drafter.k tokens
  # with the same model (drafter.draft_model); both prompt lookups propose lookup_k
  # tokens after an n-gram of drafter.max_ngram down to 1 tokens.
  lookup_k: int = 4
  hf_draft: str = ""  # the assistant's HF directory ('': exported from draft_model)
  # specjax's best method, its own row (any registry name); when it names a like-for-like
  # row (e.g. 'prompt_lookup@k=4@max_ngram=3@min_ngram=1') that row is marked '(best)'
  best: str = "eagle3@k=2"
  out: str = "/tmp/specjax_peers"
  drafter: DrafterSettings = DrafterSettings()


@dataclasses.dataclass(frozen=True)
class System:
  """One row of the table: an implementation in one decoding mode."""

  impl: str  # SPECJAX, HF or LLAMACPP
  mode: str  # 'AR', 'draft model', 'prompt lookup', 'best: <method>'
  k: Optional[int] = None
  ngram: Optional[int] = None
  method: Optional[str] = None  # specjax: the registry method name; None for AR

  @property
  def key(self) -> str:
    return f"{self.impl}|{self.mode}"


@dataclasses.dataclass
class Run:
  """One timed generation of any system."""

  tokens: list
  prefill_s: float
  decode_s: float
  decode_tokens: int
  rounds: Optional[int] = None  # target forwards after prefill, when known


def like_for_like_methods(c: PeersSettings) -> Dict[str, str]:
  """specjax's method names matching the peers' settings."""
  d = c.drafter
  return {
      "draft model": f"draft_model@k={int(d.k)}@draft_vocab=full",
      "prompt lookup": f"prompt_lookup@k={int(c.lookup_k)}@max_ngram={int(d.max_ngram)}"
                       "@min_ngram=1",
  }


def hf_draft_dir(c: PeersSettings, model: Model, progress: Callable[[str], None]) -> str:
  """The HF directory of the draft model the specjax draft_model method uses:
  `hf_draft` when given, the `draft_model` spec when it is an HF directory, else
  the distilled checkpoint exported (float32) to `out`/hf_draft."""
  if c.hf_draft:
    return str(c.hf_draft)
  spec = c.drafter.draft_model or registry.default_draft_model(model)
  if spec != "distilled" and os.path.isfile(os.path.join(spec, "config.json")):
    return spec
  checkpoint = registry.shipped_checkpoint("draft_model") if spec == "distilled" else spec
  from specjax.io import checkpoints  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(os.path.join(checkpoint, checkpoints.CARD)):
    raise ValueError(f"draft_model {spec!r}: the HF peer needs the draft model as an HF "
                     "directory; export it (experiments/export.py) and set hf_draft")
  out = os.path.join(c.out, "hf_draft")
  if not os.path.isfile(os.path.join(out, "config.json")):
    from specjax.training import draft_train  # pylint: disable=import-outside-toplevel
    progress(f"exporting the draft model {spec} to {out} (HF format, float32)")
    # The float32 target: the export carries its embedding / LM head unrounded.
    target = model if model.cfg.dtype == "float32" else load_model(model.source, "float32")
    draft_train.export_hf(checkpoint, target, out, dtype="float32", overwrite=True)
  return out


class _Peers:
  """The systems and how to run each: prompt ids -> Run."""

  def __init__(self, c: PeersSettings, model: Model, progress: Callable[[str], None]):
    self.c, self.model = c, model
    self.new = int(c.max_new_tokens)
    self.engine = specbench.Engine(model, sampling_lib.GREEDY, self.new, 0)
    self.threads = int(c.threads) or os.cpu_count() or 1
    self.systems: List[System] = []
    self.runners: Dict[str, Callable] = {}
    self.settings: Dict[str, dict] = {}
    self.skipped: Dict[str, str] = {}
    self.drafters: Dict[str, tuple] = {}
    self.closers: List[Callable[[], None]] = []  # peers' child processes
    like = like_for_like_methods(c)
    k, max_ngram = int(c.drafter.k), int(c.drafter.max_ngram)

    self._add(System(SPECJAX, "AR"), lambda p, rid: self._specjax(None, p, rid))
    specjax_methods = {"draft model": System(SPECJAX, "draft model", k, None,
                                             like["draft model"]),
                       "prompt lookup": System(SPECJAX, "prompt lookup", int(c.lookup_k),
                                               max_ngram, like["prompt lookup"])}
    best = str(c.best or "").strip()
    if best in like.values():  # one of the like-for-like rows: run once, say so
      mode = next(m for m, name in like.items() if name == best)
      specjax_methods[mode] = dataclasses.replace(specjax_methods[mode], mode=f"{mode} (best)")
    elif best:  # built now: a bad name fails before any timing
      self.drafters[best] = registry.make_drafter(best, c.drafter, model,
                                                  sampling=sampling_lib.GREEDY)
      drafter = self.drafters[best][0]
      specjax_methods["best"] = System(SPECJAX, f"best: {best}", drafter.k,
                                       getattr(drafter, "max_ngram", None), best)

    hf_ar = hf_assist = hf_lookup = None
    if c.hf:
      progress(f"loading the HF transformers peer ({c.hf_dtype}) from {model.source}")
      self.hf_model = hf.load_hf_model(model.source, str(c.hf_dtype))
      draft_dir = hf_draft_dir(c, model, progress)
      self.assistant = hf.load_hf_model(draft_dir, str(c.hf_dtype))
      hf.configure_assistant(self.assistant, k)
      hf.set_threads(self.threads)  # so the settings record what the runs use
      hf_ar, hf_assist = System(HF, "AR"), System(HF, "assisted", k)
      hf_lookup = System(HF, "prompt lookup", int(c.lookup_k), max_ngram)
      self.settings[hf_ar.key] = hf.settings(self.hf_model)
      self.settings[hf_assist.key] = dict(hf.settings(self.hf_model, mode="assisted",
                                                      assistant=self.assistant, k=k),
                                          assistant_dir=draft_dir)
      self.settings[hf_lookup.key] = hf.settings(self.hf_model, mode="prompt_lookup",
                                                 k=int(c.lookup_k), max_ngram=max_ngram)
    else:
      self.skipped[HF] = "disabled (hf=False)"

    # Interleaved order: each peer mode next to its specjax counterpart.
    if hf_ar:
      self._add(hf_ar, self._hf_ar)
      self._add(hf_assist, self._hf_assisted)
    self._add_specjax(specjax_methods["draft model"])
    if hf_lookup:
      self._add(hf_lookup, self._hf_lookup)
    self._add_specjax(specjax_methods["prompt lookup"])
    self._add_llamacpp(progress)
    if "best" in specjax_methods:
      self._add_specjax(specjax_methods["best"])
    self.settings[SPECJAX] = specjax_settings(model, {
        s.mode: f"{s.method} "
                f"({registry.drafter_id(s.method, c.drafter, model) or 'training-free'})"
        for s in self.systems if s.impl == SPECJAX and s.method})

  # --- construction ---

  def _add(self, system: System, runner: Callable) -> None:
    self.systems.append(system)
    self.runners[system.key] = runner

  def _add_specjax(self, system: System) -> None:
    def run(prompt, rid, m=system.method):
      if m not in self.drafters:
        self.drafters[m] = registry.make_drafter(m, self.c.drafter, self.model,
                                                 sampling=sampling_lib.GREEDY)
      return self._specjax(self.drafters[m], prompt, rid)
    self._add(system, run)

  def _add_llamacpp(self, progress) -> None:
    c = self.c
    if not c.llamacpp:
      self.skipped[LLAMACPP] = "disabled (llamacpp=False)"
      return
    if not llamacpp.available():
      self.skipped[LLAMACPP] = f"llama-cpp-python not installed: {llamacpp.EXTRA_HINT}"
      return
    if not str(self.model.source).endswith(".gguf"):
      self.skipped[LLAMACPP] = f"needs a GGUF file, the model is {self.model.source}"
      return
    progress(f"loading the llama.cpp peer ({self.threads} threads, a process of its own)")
    kw = dict(n_ctx=int(c.llamacpp_ctx), threads=self.threads)
    ar_llm = llamacpp.LlamaCppProcess(self.model.source, **kw)
    self.closers.append(ar_llm.close)
    system = System(LLAMACPP, "AR")
    self.settings[system.key] = llamacpp.settings(ar_llm)
    self._add(system, lambda p, rid: self._llamacpp(ar_llm, p))
    if llamacpp.has_prompt_lookup():
      k, n = int(c.lookup_k), int(c.drafter.max_ngram)
      pl_llm = llamacpp.LlamaCppProcess(self.model.source, prompt_lookup=(k, n), **kw)
      self.closers.append(pl_llm.close)
      system = System(LLAMACPP, "prompt lookup", k, n)
      self.settings[system.key] = llamacpp.settings(pl_llm, mode="prompt_lookup", k=k,
                                                    max_ngram=n)
      self._add(system, lambda p, rid: self._llamacpp(pl_llm, p))

  # --- runners ---

  def _specjax(self, drafter, prompt, rid) -> Run:
    dparams = None
    if drafter is not None:
      drafter, dparams = drafter
    res = self.engine.run(drafter, dparams, [prompt], [rid])
    tokens = res.tokens[0]
    rounds = res.stats.get("rounds", res.stats.get("decode_steps"))
    return Run(tokens, res.prefill_s, res.decode_s, max(len(tokens) - 1, 0), rounds)

  def _hf(self, res) -> Run:
    return Run(res.tokens, res.prefill_s, res.decode_s, res.decode_tokens, res.rounds)

  def _hf_ar(self, prompt, rid, new=None):
    del rid
    return self._hf(hf.hf_greedy_generate(self.hf_model, prompt, new or self.new, self.threads))

  def _hf_assisted(self, prompt, rid, new=None):
    del rid
    return self._hf(hf.hf_assisted_generate(self.hf_model, self.assistant, prompt,
                                            new or self.new, int(self.c.drafter.k),
                                            self.threads))

  def _hf_lookup(self, prompt, rid, new=None):
    del rid
    return self._hf(hf.hf_prompt_lookup_generate(self.hf_model, prompt, new or self.new,
                                                 int(self.c.lookup_k),
                                                 int(self.c.drafter.max_ngram),
                                                 self.threads))

  def _llamacpp(self, llm, prompt) -> Run:
    res = llm.greedy_generate(prompt, self.new, eos_ids=[self.model.cfg.eos_id])
    return Run(res.tokens, res.prefill_s, res.decode_s, res.decode_tokens)

  def close(self) -> None:
    for close in self.closers:
      close()
    self.closers = []

  def warm_up(self, prompt, rid) -> None:
    """One untimed run of every peer mode (specjax's engine excludes its compiles)."""
    for s in self.systems:
      if s.impl != SPECJAX:
        self.runners[s.key](prompt, rid)


def specjax_settings(model: Model, methods: Dict[str, str]) -> dict:
  return {"precision": model.cfg.dtype, "methods": methods, "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
          "timing": "decode loop after prefill; compile runs (one per method and prompt "
                    "bucket) excluded"}


# --- the run --------------------------------------------------------------------------


def _settings(c: PeersSettings) -> dict:
  return report.config_settings(c.flat(), SETTINGS)


def _new_record(q, system: System, repeats: int, settings_id: str) -> dict:
  return {"question_id": q.question_id, "category": q.category, "settings": settings_id,
          "key": system.key, "impl": system.impl, "mode": system.mode, "k": system.k,
          "ngram": system.ngram, "method": system.method, "prompt_tokens": [],
          "decode_tokens": 0, "decode_s": [0.0] * repeats, "prefill_s": [0.0] * repeats,
          "rounds": 0, "tokens": [], "identical": True}


def _run_question(peers: _Peers, q, repeats: int, settings_id: str,
                  note: Callable[[str], None]) -> List[dict]:
  model = peers.model
  tok, eos = model.tokenizer, model.cfg.eos_id
  systems = peers.systems
  recs = {s.key: _new_record(q, s, repeats, settings_id) for s in systems}
  own_ar = {s.impl: f"{s.impl}|AR" for s in systems}
  answers = []
  for t in range(len(q.turns)):
    prompt = tok.encode_chat(questions_lib.chat_messages(q.turns[:t + 1], answers))
    rid = q.question_id * questions_lib.TURN_IDS + t
    first = {}
    for r in range(repeats):
      shift = r % len(systems)
      for s in systems[shift:] + systems[:shift]:
        note(f"q{q.question_id} turn {t + 1} {s.impl} {s.mode} repeat {r + 1}/{repeats}")
        run = peers.runners[s.key](prompt, rid)
        rec = recs[s.key]
        rec["decode_s"][r] += run.decode_s
        rec["prefill_s"][r] += run.prefill_s
        if r == 0:
          first[s.key] = run
          rec["prompt_tokens"].append(len(prompt))
          rec["decode_tokens"] += run.decode_tokens
          rec["tokens"].append(run.tokens)
          rec["rounds"] = None if run.rounds is None or rec["rounds"] is None else (
              rec["rounds"] + run.rounds)
    for s in systems:
      ref = first[own_ar[s.impl]].tokens if own_ar[s.impl] in first else None
      same = None if ref is None else ar_bench.compare_greedy(
          first[s.key].tokens, ref, eos)["identical_up_to_eos"]
      rec = recs[s.key]
      rec["identical"] = None if same is None or rec["identical"] is None else (
          rec["identical"] and same)
    answers.append(tok.decode(first[f"{SPECJAX}|AR"].tokens, skip_special_tokens=True))
  return [recs[s.key] for s in systems]


def _ratio(a, b):
  return report.ratio(a, b, missing=None)


def summarize(records: List[dict], systems: List[System]) -> List[dict]:
  """One row per system over all questions (see the module docstring)."""
  rows = []
  for s in systems:
    rs = [r for r in records if r["key"] == s.key]
    if not rs:
      continue
    dec = sum(statistics.median(r["decode_s"]) for r in rs)
    tokens = sum(r["decode_tokens"] for r in rs)
    rounds = None if any(r["rounds"] is None for r in rs) else sum(r["rounds"] for r in rs)
    ident = [r["identical"] for r in rs]
    rows.append({
        "impl": s.impl, "mode": s.mode, "k": s.k, "ngram": s.ngram, "method": s.method,
        "key": s.key, "num_prompts": len(rs), "decode_tokens": tokens, "decode_s": dec,
        "tokens_per_s": _ratio(tokens, dec),
        "prefill_s": sum(statistics.median(r["prefill_s"]) for r in rs),
        "tokens_per_round": _ratio(tokens, rounds) if rounds else None,
        "greedy_identical": None if None in ident else all(ident),
    })
  by_key = {r["key"]: r for r in rows}
  hf_ar = by_key.get(f"{HF}|AR")
  for r in rows:
    own = by_key.get(f"{r['impl']}|AR")
    r["speedup_vs_own_ar"] = _ratio(r["tokens_per_s"], own and own["tokens_per_s"])
    r["speedup_vs_hf_ar"] = _ratio(r["tokens_per_s"], hf_ar and hf_ar["tokens_per_s"])
  return rows


def run_peers(c: PeersSettings, model: Optional[Model] = None,
              progress: Optional[Callable[[str], None]] = None) -> dict:
  """Run (or resume) the side-by-side benchmark of settings `c` (`PeersSettings.of`
  reads configs/peers.py's ConfigDict).

  Writes `c.out`/log.jsonl, results.json, results.md. Returns the results
  dict (its "markdown" entry holds the table)."""
  require(c, PeersSettings, "peers.run_peers")
  t_start = time.perf_counter()
  commit = report.git_commit()
  progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
  for name, low in (("repeats", 1), ("max_new_tokens", 1), ("threads", 0),
                    ("llamacpp_ctx", 1), ("lookup_k", 1)):  # prompt_limit: load_questions
    require_whole(name, getattr(c, name), low)
  repeats = int(c.repeats)
  if c.hf and not hf.available():
    raise ImportError(f"hf=True needs the 'peers' extra: {hf.EXTRA_HINT}")
  questions = questions_lib.load_questions(c.prompts, c.prompt_limit)
  os.makedirs(c.out, exist_ok=True)
  settings = _settings(c)
  settings_id = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
  log_path = os.path.join(c.out, LOG)
  old = specbench.read_log(log_path)
  if any(r["settings"] != settings_id for r in old):
    raise ValueError(f"{log_path} holds results of other settings; use another `out` "
                     f"directory (settings now: {settings})")

  model = model or load_model(c.model, c.dtype, tokenizer_from=c.tokenizer_from or None)
  if model.tokenizer is None:
    raise ValueError(f"model {c.model!r} has no tokenizer: set tokenizer_from")
  peers = _Peers(c, model, progress)
  try:
    keys = [s.key for s in peers.systems]
    done = {}
    for r in old:
      done.setdefault(r["question_id"], {})[r["key"]] = r
    todo = [q for q in questions if set(keys) - set(done.get(q.question_id, {}))]
    if todo:
      progress("warm-up: one untimed run of each peer mode")
      peers.warm_up(model.tokenizer.encode_chat(questions_lib.chat_messages(todo[0].turns[:1], [])),
                    todo[0].question_id * questions_lib.TURN_IDS)
    for n, q in enumerate(todo):
      def note(line, n=n):
        progress(f"[{n + 1}/{len(todo)} prompts] {q.category} {line} | elapsed "
                 f"{time.perf_counter() - t_start:.0f} s")
      recs = _run_question(peers, q, repeats, settings_id, note)
      with open(log_path, "a") as f:
        for rec in recs:
          f.write(json.dumps(rec) + "\n")
      done[q.question_id] = {rec["key"]: rec for rec in recs}

  finally:
    peers.close()  # the peers' child processes

  wanted = {q.question_id for q in questions}
  records = [r for qid, by_key in done.items() if qid in wanted
             for k, r in by_key.items() if k in keys]
  rows = summarize(records, peers.systems)
  out = {
      "config": c.flat(), "results": rows,
      "best_against_best": peers_report.best_against_best(rows),
      "settings": peers.settings, "skipped": peers.skipped, "num_prompts": len(questions),
      "commit": commit, "hardware": {**report.hardware(), "python": platform.python_version()},
      "runtime_s": time.perf_counter() - t_start, "compile_s": peers.engine.compile_s,
  }
  out["markdown"] = peers_report.format_markdown(out)
  with open(os.path.join(c.out, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(c.out, "results.md"), "w") as f:
    f.write(out["markdown"])
  return out
