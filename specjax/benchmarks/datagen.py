"""How fast can this machine write self-distillation answers? Ways side by side.

Bulk answer generation (`specjax.training.distill_data`) is throughput-bound:
what matters is answer tokens per second over a realistic mix of prompts and
answer lengths, not the latency of one request. This benchmark answers the
same prompts (the training sources, decontaminated) with each way and reports
tokens/s of each, measured in one run and interleaved (way A, way B, way A,
...), so that the ratios compare like with like:

  static      autoregressive.generate on batches of `batch_size` prompts
              sorted by length: a batch runs until its longest answer ends
  continuous  specjax.decoding.continuous, one run per prompt-length bucket
              (its cache sized for the bucket): `batch_size` rows, a
              finished row takes the next prompt

each in float32 and bfloat16. Greedy answers; the first pass of each way
compiles and is not timed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import continuous
from specjax.io.load import load_model
from specjax.settings import RunSettings, require
from specjax.training import distill_data

WAYS = ("static", "continuous")


@dataclasses.dataclass(frozen=True)
class DatagenSettings(RunSettings):
  """An answer-throughput run (`experiments/datagen.py`, configs/datagen.py)."""

  model: str = "smollm2-135m"
  sources: str = "alpaca,code_alpaca,gpteacher_code,gsm8k_train,xsum"  # training prompt sources
  num_prompts: int = 64
  max_prompt_tokens: int = 512
  max_new_tokens: int = 256
  batch_size: int = 16
  dtypes: str = "float32,bfloat16"
  ways: str = "static,continuous"  # of WAYS
  repeats: int = 2
  seed: int = 0
  out: str = ""  # a folder for results.json / results.md (optional)


def _static(model, prompts: Sequence[List[int]], batch_size: int, max_new_tokens: int):
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  tokens = 0
  for i in range(0, len(order), batch_size):
    chunk = [prompts[j] for j in order[i:i + batch_size]]
    res = ar.generate(model.params, model.cfg, chunk, sampling=sampling_lib.GREEDY,
                      max_new_tokens=max_new_tokens, request_ids=order[i:i + batch_size])
    tokens += res.num_new_tokens
  return tokens


def _continuous(model, prompts: Sequence[List[int]], batch_size: int, max_new_tokens: int,
                max_prompt_tokens: int):
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  tokens = 0
  for _, answer in continuous.generate_bucketed(model.params, model.cfg,
                                                ((i, prompts[i]) for i in order),
                                                batch_size=batch_size,
                                                max_new_tokens=max_new_tokens,
                                                max_prompt_tokens=max_prompt_tokens):
    tokens += len(answer)
  return tokens


def run(c: DatagenSettings, progress: Optional[Callable[[str], None]] = None) -> Dict:
  """The ways of settings `c` (`DatagenSettings.of(config)` reads
  configs/datagen.py's ConfigDict) -> {"rows": [...], "markdown": str}"""
  require(c, DatagenSettings, "datagen.run")
  progress = progress or print
  sources = [s for s in c.sources.split(",") if s]
  dtypes = [d for d in c.dtypes.split(",") if d]
  ways = [w for w in c.ways.split(",") if w]
  for w in ways:
    if w not in WAYS:
      raise ValueError(f"unknown way {w!r}; available: {', '.join(WAYS)}")
  examples = distill_data.interleave(sources, distill_data.load_instructions(sources),
                                     10 * c.num_prompts, c.seed)
  rows = []
  for dtype in dtypes:
    # the default forward: generation runs large batches (its GEMM is the faster
    # there) and its bits need not match any other run's
    model = load_model(c.model, dtype=dtype, batch_invariant=False)
    prompts = [p for p in (model.tokenizer.encode_prompt(t) for _, t in examples)
               if len(p) <= c.max_prompt_tokens][:c.num_prompts]
    if len(prompts) < c.num_prompts:
      raise ValueError(f"only {len(prompts)} prompts of <= {c.max_prompt_tokens} tokens")

    def once(way):
      t0 = time.perf_counter()
      if way == "static":
        n = _static(model, prompts, c.batch_size, c.max_new_tokens)
      else:
        n = _continuous(model, prompts, c.batch_size, c.max_new_tokens, c.max_prompt_tokens)
      return n, time.perf_counter() - t0

    for way in ways:  # compile pass, untimed
      once(way)
      progress(f"{dtype} {way}: compiled")
    times = {w: [] for w in ways}
    tokens = {}
    for r in range(c.repeats):
      for way in ways:
        n, s = once(way)
        tokens[way] = n
        times[way].append(n / s)
        progress(f"{dtype} {way} [{r + 1}/{c.repeats}]: {n} tokens, {n / s:.1f} tokens/s")
    for way in ways:
      rows.append({"way": way, "dtype": dtype, "batch_size": c.batch_size,
                   "prompts": len(prompts), "new_tokens": tokens[way],
                   "tokens_per_s": float(np.median(times[way])),
                   "tokens_per_s_all": times[way]})
  base = max(r["tokens_per_s"] for r in rows if r["way"] == "static")
  for r in rows:
    r["vs_fastest_static"] = r["tokens_per_s"] / base
  lines = ["| way | dtype | batch | prompts | answer tokens | tokens/s (median) | "
           "vs fastest static |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['way']} | {r['dtype']} | {r['batch_size']} | {r['prompts']} | "
                 f"{r['new_tokens']} | {r['tokens_per_s']:.1f} | {r['vs_fastest_static']:.2f}x |")
  return {"rows": rows, "markdown": "\n".join(lines)}
