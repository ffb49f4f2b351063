"""How fast can this machine write self-distillation answers? Ways side by side.

Bulk answer generation (`specjax.training.distill_data`) is throughput-bound:
what matters is answer tokens per second over a realistic mix of prompts and
answer lengths, not the latency of one request. This benchmark answers the
same prompts (the training sources, decontaminated) with each way and reports
tokens/s of each, measured in one run and interleaved (every way once, then
every way again, ...), so that the ratios compare like with like:

  static      specjax: autoregressive.generate on batches of `batch_size`
              prompts sorted by length: a batch runs until its longest answer
              ends
  continuous  specjax: specjax.decoding.continuous, one run per prompt-length
              bucket (its cache sized for the bucket): `batch_size` rows, a
              finished row takes the next prompt
  hf          HF transformers (PyTorch CPU, the `peers` extra) on the same
              GGUF file, dequantized to `hf_dtype`: `generate` on the same
              static batches (left-padded)
  llamacpp    llama.cpp (llama-cpp-python, the optional `llamacpp` extra) on
              the GGUF's own quantized tensors, one prompt at a time (its
              Python API decodes one sequence), in a process of its own

specjax's ways run in each of `dtypes`, the peers once. Greedy answers. The
first pass of each specjax way compiles every shape it meets and is not
timed; a peer warms up on the first `batch_size` prompts. Each row counts
the answers equal, token for token, to the first way's: the data a way
writes is the target's only where they agree (llama.cpp's quantized
arithmetic is not specjax's float32 dequantized forward).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from specjax import sampling as sampling_lib
from specjax.checks import require_whole
from specjax.decoding import autoregressive as ar
from specjax.decoding import continuous
from specjax.io.load import load_model
from specjax.settings import RunSettings, require
from specjax.training import distill_data

WAYS = ("static", "continuous", "hf", "llamacpp")
PEER_WAYS = ("hf", "llamacpp")


@dataclasses.dataclass(frozen=True)
class DatagenSettings(RunSettings):
  """An answer-throughput run (`experiments/datagen.py`, configs/datagen.py)."""

  model: str = "smollm2-135m"
  sources: str = "alpaca,code_alpaca,gpteacher_code,gsm8k_train,xsum"  # training prompt sources
  num_prompts: int = 64
  max_prompt_tokens: int = 512
  max_new_tokens: int = 256
  batch_size: int = 16
  dtypes: str = "float32,bfloat16"  # specjax's ways run in each
  ways: str = "static,continuous"  # of WAYS
  hf_dtype: str = "float32"  # torch dtype of the `hf` way
  repeats: int = 2
  seed: int = 0
  out: str = ""  # a folder for results.json / results.md (optional)


def _by_length(prompts: Sequence[List[int]]) -> List[int]:
  return sorted(range(len(prompts)), key=lambda i: len(prompts[i]))


def _static_batches(prompts: Sequence[List[int]], batch_size: int,
                    limit: Optional[int] = None) -> List[List[int]]:
  """The prompts' indices in static batches of `batch_size`, by length (the first `limit`)."""
  order = _by_length(prompts)[:limit]
  return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _static(model, prompts: Sequence[List[int]], batch_size: int,
            max_new_tokens: int) -> Dict[int, List[int]]:
  answers = {}
  for ids in _static_batches(prompts, batch_size):
    res = ar.generate(model.params, model.cfg, [prompts[j] for j in ids],
                      sampling=sampling_lib.GREEDY, max_new_tokens=max_new_tokens,
                      request_ids=ids)
    answers.update(zip(ids, (list(t) for t in res.tokens)))
  return answers


def _continuous(model, prompts: Sequence[List[int]], batch_size: int, max_new_tokens: int,
                max_prompt_tokens: int) -> Dict[int, List[int]]:
  requests = ((i, prompts[i]) for i in _by_length(prompts))
  return {i: list(answer) for i, answer in continuous.generate_bucketed(
      model.params, model.cfg, requests, batch_size=batch_size,
      max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens)}


def _hf(hf_model, eos_id: int, prompts: Sequence[List[int]], batch_size: int,
        max_new_tokens: int, limit: Optional[int] = None) -> Dict[int, List[int]]:
  from specjax.peers import hf  # pylint: disable=import-outside-toplevel
  answers = {}
  for ids in _static_batches(prompts, batch_size, limit):
    answers.update(zip(ids, hf.hf_batch_generate(hf_model, [prompts[j] for j in ids],
                                                 max_new_tokens, eos_ids=[eos_id])))
  return answers


def _llamacpp(llm, eos_id: int, prompts: Sequence[List[int]], max_new_tokens: int,
              limit: Optional[int] = None) -> Dict[int, List[int]]:
  return {i: list(llm.greedy_generate(prompts[i], max_new_tokens, eos_ids=[eos_id]).tokens)
          for i in _by_length(prompts)[:limit]}


def run(c: DatagenSettings, progress: Optional[Callable[[str], None]] = None) -> Dict:
  """The ways of settings `c` (`DatagenSettings.of(config)` reads
  configs/datagen.py's ConfigDict) -> {"rows": [...], "markdown": str}"""
  require(c, DatagenSettings, "datagen.run")
  for name, low in (("num_prompts", 1), ("max_prompt_tokens", 1), ("max_new_tokens", 1),
                    ("batch_size", 1), ("repeats", 1), ("seed", 0)):
    require_whole(name, getattr(c, name), low)
  progress = progress or print
  sources = [s for s in c.sources.split(",") if s]
  dtypes = [d for d in c.dtypes.split(",") if d]
  ways = [w for w in c.ways.split(",") if w]
  for w in ways:
    if w not in WAYS:
      raise ValueError(f"unknown way {w!r}; available: {', '.join(WAYS)}")
  if not any(w not in PEER_WAYS for w in ways) or not dtypes:
    raise ValueError(f"ways={c.ways!r}, dtypes={c.dtypes!r}: at least one specjax way "
                     f"(static, continuous) in at least one dtype")
  if "hf" in ways:
    from specjax.peers import hf  # pylint: disable=import-outside-toplevel
    if not hf.available():
      raise ImportError(f"the 'hf' way needs the optional 'peers' extra: {hf.EXTRA_HINT}")
  if "llamacpp" in ways:
    from specjax.peers import llamacpp  # pylint: disable=import-outside-toplevel
    if not llamacpp.available():
      raise ImportError(f"the 'llamacpp' way needs llama-cpp-python: {llamacpp.EXTRA_HINT}")
  examples = distill_data.interleave(sources, distill_data.load_instructions(sources),
                                     10 * c.num_prompts, c.seed)
  # the default forward: generation runs large batches (its GEMM is the faster
  # there) and its bits need not match any other run's
  models = {d: load_model(c.model, dtype=d, batch_invariant=False) for d in dtypes}
  first = models[dtypes[0]]
  prompts = [p for p in (first.tokenizer.encode_prompt(t) for _, t in examples)
             if len(p) <= c.max_prompt_tokens][:c.num_prompts]
  if len(prompts) < c.num_prompts:
    raise ValueError(f"only {len(prompts)} prompts of <= {c.max_prompt_tokens} tokens")
  eos = first.cfg.eos_id

  # (way, dtype, batch, run(limit) -> answers by prompt index), in run order;
  # `limit` (the warm-up's: the first prompts by length) is for the peers,
  # specjax's ways warm up on every prompt (each shape compiles once)
  runners = []
  for dtype in dtypes:
    model = models[dtype]
    for way in ways:
      if way == "static":
        runners.append((way, dtype, c.batch_size, lambda _, m=model: _static(
            m, prompts, c.batch_size, c.max_new_tokens)))
      elif way == "continuous":
        runners.append((way, dtype, c.batch_size, lambda _, m=model: _continuous(
            m, prompts, c.batch_size, c.max_new_tokens, c.max_prompt_tokens)))
  closers = []
  if "hf" in ways:
    hf_model = hf.load_hf_model(first.source, c.hf_dtype)
    runners.append(("hf", c.hf_dtype, c.batch_size, lambda lim: _hf(
        hf_model, eos, prompts, c.batch_size, c.max_new_tokens, lim)))
  if "llamacpp" in ways:
    if not str(first.source).endswith(".gguf"):
      raise ValueError(f"the 'llamacpp' way reads a GGUF file; model {c.model!r} is "
                       f"{first.source!r}")
    llm = llamacpp.LlamaCppProcess(
        first.source, n_ctx=c.max_prompt_tokens + c.max_new_tokens + 8)
    closers.append(llm.close)
    runners.append(("llamacpp", "gguf", 1, lambda lim: _llamacpp(
        llm, eos, prompts, c.max_new_tokens, lim)))
  try:
    for way, dtype, _, fn in runners:  # compile pass (specjax: every shape), untimed
      fn(c.batch_size if way in PEER_WAYS else None)
      progress(f"{dtype} {way}: warmed up")
    times = {(w, d): [] for w, d, _, _ in runners}
    answers = {}
    for r in range(c.repeats):
      for way, dtype, _, fn in runners:
        t0 = time.perf_counter()
        got = fn(None)
        s = time.perf_counter() - t0
        n = sum(len(a) for a in got.values())
        answers[(way, dtype)] = got
        times[(way, dtype)].append(n / s)
        progress(f"{dtype} {way} [{r + 1}/{c.repeats}]: {n} tokens, {n / s:.1f} tokens/s")
  finally:
    for close in closers:
      close()
  ref_way, ref_dtype = runners[0][0], runners[0][1]
  ref = answers[(ref_way, ref_dtype)]
  rows = []
  for way, dtype, batch, _ in runners:
    got = answers[(way, dtype)]
    rows.append({"way": way, "dtype": dtype, "batch_size": batch, "prompts": len(got),
                 "new_tokens": sum(len(a) for a in got.values()),
                 "tokens_per_s": float(np.median(times[(way, dtype)])),
                 "tokens_per_s_all": times[(way, dtype)],
                 "same_answers": sum(got[i] == ref[i] for i in ref),
                 "reference": f"{ref_way} {ref_dtype}"})
  statics = [r["tokens_per_s"] for r in rows if r["way"] == "static"]
  base = max(statics) if statics else max(r["tokens_per_s"] for r in rows)
  base_name = "fastest static" if statics else "fastest way"
  for r in rows:
    r["vs_fastest_static"] = r["tokens_per_s"] / base
  lines = [f"| way | dtype | batch | prompts | answer tokens | tokens/s (median) | "
           f"vs {base_name} | answers = {ref_way} {ref_dtype}'s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['way']} | {r['dtype']} | {r['batch_size']} | {r['prompts']} | "
                 f"{r['new_tokens']} | {r['tokens_per_s']:.1f} | {r['vs_fastest_static']:.2f}x | "
                 f"{r['same_answers']}/{r['prompts']} |")
  return {"rows": rows, "markdown": "\n".join(lines)}
