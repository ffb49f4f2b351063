"""The foundation benchmark: autoregressive greedy decoding against the memory
roofline and against HF transformers on the same GGUF weights.

Every speedup of a speculative method is a ratio to this baseline, so it is
measured the way the later benchmarks will be:

* decode only: prefill (time to first token) is reported apart, and decode
  rates count the tokens after the first, over the time after the first
  (specjax's `GenerateResult`, HF via `specjax.peers.hf`'s streamer clock);
* compile / warm-up runs are excluded; medians and inter-quartile ranges over
  `repeats` timed runs;
* the peer runs interleaved with specjax (specjax B=1, then HF, every repeat),
  so both see the same machine load; the speedup is the median of the
  per-repeat ratios;
* the roofline is weight bytes / best measured read bandwidth: a floor on the
  time of one decode step at any batch size that stays memory-bound. The KV
  cache the step attends over is reported beside it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence, Tuple

import jax
import numpy as np

from specjax import runner
from specjax import sampling as sampling_lib
from specjax.analysis import roofline
from specjax.benchmarks import report
from specjax.checks import require_real, require_whole
from specjax.decoding import autoregressive
from specjax.errors import ConfigValueError
from specjax.io.load import Model, load_model
from specjax.peers import hf  # imports torch / transformers only when used
from specjax.settings import RunSettings, require


@dataclasses.dataclass(frozen=True)
class ARBenchmarkSettings(RunSettings):
  """An AR benchmark run (`experiments/ar_benchmark.py`, configs/ar_benchmark.py)."""

  model: str = "smollm2-135m"
  dtype: str = "float32"
  # A prompt the model answers at length, so every run decodes max_new_tokens.
  prompt: str = "Write a long story about a lighthouse keeper who finds a message in a bottle."
  system: Optional[str] = None
  max_new_tokens: int = 128
  batch_sizes: Tuple[int, ...] = (1, 4, 16)  # the prompt repeated B times
  repeats: int = 5  # timed runs per configuration, after a compile / warm-up run
  peers: bool = hf.available()  # HF transformers side by side (the `peers` extra)
  bandwidth_gib: float = 1.0  # size of the read-bandwidth probe
  out: Optional[str] = None  # JSON results path (written by experiments/ar_benchmark.py)


def spread(values: Sequence[float]) -> dict:
  """Median and inter-quartile range (q1, q3) of timed repeats."""
  v = [float(x) for x in values]
  if len(v) == 1:
    return {"median": v[0], "q1": v[0], "q3": v[0], "n": 1}
  q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
  return {"median": statistics.median(v), "q1": q1, "q3": q3, "n": len(v)}


def compare_greedy(a: Sequence[int], b: Sequence[int], eos_id: int) -> dict:
  a, b = report.upto_eos(a, eos_id), report.upto_eos(b, eos_id)
  mismatch = report.first_divergence(a, b)
  return {"identical_up_to_eos": mismatch is None, "first_mismatch": mismatch,
          "specjax_tokens": len(a), "hf_tokens": len(b)}


def kv_cache_bytes(model: Model, batch_size: int, num_slots: int) -> int:
  """Bytes of the K and V buffers one decode step attends over (all slots)."""
  c = model.cfg
  return (2 * c.num_layers * batch_size * num_slots * c.num_kv_heads * c.head_dim *
          np.dtype(c.jnp_dtype).itemsize)


def _specjax_row(b: int, runs: list, compile_s: float, model: Model, wbytes: int,
                 gbps: float, ref_tokens: Optional[list]) -> dict:
  steps = [r.stats["decode_steps"] for r in runs]
  ms_step = [1e3 * r.decode_s / max(s, 1) for r, s in zip(runs, steps)]
  agg = [r.decode_tokens_per_s for r in runs]
  kv = kv_cache_bytes(model, b, runs[0].num_slots)
  floor = roofline.roofline_ms_per_token(wbytes, gbps)
  eos = model.cfg.eos_id
  rows = [report.upto_eos(t, eos) for t in runs[-1].tokens]
  return {
      "impl": "specjax",
      "batch_size": b,
      "new_tokens_per_row": [len(t) for t in runs[-1].tokens],
      "decode_steps": steps[-1],
      "ms_per_step": spread(ms_step),
      "tokens_per_s_per_row": spread([a / b for a in agg]),
      "tokens_per_s_aggregate": spread(agg),
      "prefill_s": spread([r.prefill_s for r in runs]),
      "compile_run_s": compile_s,
      "roofline_ms_per_step": floor,
      "roofline_ratio": statistics.median(ms_step) / floor,
      "num_slots": runs[0].num_slots,
      "kv_cache_bytes": kv,
      "roofline_with_kv_ms_per_step": roofline.roofline_ms_per_token(wbytes + kv, gbps),
      "rows_match_b1": None if ref_tokens is None else all(r == ref_tokens for r in rows),
  }


def run_ar_benchmark(c: ARBenchmarkSettings, model: Optional[Model] = None,
                     prompt_ids: Optional[Sequence[int]] = None, hf_model=None,
                     log: Optional[Callable[[str], None]] = None) -> dict:
  """Run the benchmark of settings `c` (`ARBenchmarkSettings.of(config)` reads
  configs/ar_benchmark.py's ConfigDict).

  Args:
    c: the run's ARBenchmarkSettings.
    model: an already loaded model (default: load `c.model` with `c.dtype`).
    prompt_ids: token ids (default: the chat-templated `c.prompt`).
    hf_model: the transformers model of the same weights, when `c.peers`
      (default: loaded from the model's GGUF file).
    log: called with one line of progress at a time (default: silent).
  Returns:
    A JSON-serializable dict of figures; `format_table` renders it.
  """
  require(c, ARBenchmarkSettings, "ar.run_ar_benchmark")
  log = log or (lambda line: None)
  t_start = time.perf_counter()
  require_whole("repeats", c.repeats, 1)
  require_whole("max_new_tokens", c.max_new_tokens, 1)
  require_real("bandwidth_gib", c.bandwidth_gib, 0.0, low_open=True,
               why="the read-bandwidth probe's size")
  if not c.batch_sizes:
    raise ConfigValueError("batch_sizes: no batch sizes (e.g. (1, 4, 16))")
  for b in c.batch_sizes:
    require_whole("batch_sizes", b, 1)
  repeats, new = int(c.repeats), int(c.max_new_tokens)
  batch_sizes = [int(b) for b in c.batch_sizes]
  if c.peers and 1 not in batch_sizes:
    batch_sizes = [1] + batch_sizes  # the peer is compared at B=1

  bw = roofline.measure_read_bandwidth(int(float(c.bandwidth_gib) * (1 << 30)),
                                       repeats=max(repeats, 3))
  gbps = bw["best_gbps"]
  log(f"read bandwidth: best {gbps:.1f} GB/s, median {bw['median_gbps']:.1f} GB/s "
      f"({bw['bytes'] / 2**30:.2f} GiB)")

  model = model or load_model(c.model, c.dtype)
  if prompt_ids is None:
    if model.tokenizer is None:
      raise ValueError(f"model {c.model!r} has no tokenizer: pass prompt_ids")
    prompt_ids = model.tokenizer.encode_prompt(c.prompt, system=c.system)
  prompt_ids = [int(t) for t in prompt_ids]
  wbytes = roofline.weight_bytes(model.params)
  floor = roofline.roofline_ms_per_token(wbytes, gbps)
  log(f"weights {wbytes / 1e6:.1f} MB ({model.cfg.dtype}) -> roofline {floor:.1f} ms/step")

  if not c.peers:
    hf_model = None
  elif hf_model is None:
    if not str(model.source).endswith(".gguf"):
      raise ValueError(f"the HF peer loads GGUF files; model source is {model.source!r}")
    hf_model = hf.load_hf_gguf(model.source)

  def run_specjax(b):
    return autoregressive.generate(model.params, model.cfg, [prompt_ids] * b, key=0,
                                   sampling=sampling_lib.GREEDY, max_new_tokens=new)

  compile_s = {}
  for b in batch_sizes:  # compile runs, excluded
    t0 = time.perf_counter()
    run_specjax(b)
    compile_s[b] = time.perf_counter() - t0
    log(f"specjax B={b}: compile + first run {compile_s[b]:.1f} s")
  if hf_model is not None:
    hf.hf_greedy_generate(hf_model, prompt_ids, new)  # warm-up, excluded

  runs = {b: [] for b in batch_sizes}
  hf_runs = []
  for i in range(repeats):
    for b in batch_sizes:
      r = run_specjax(b)
      runs[b].append(r)
      log(f"[{i + 1}/{repeats}] specjax B={b}: {1e3 * r.decode_s / max(r.stats['decode_steps'], 1):.1f}"
          f" ms/step, {r.decode_tokens_per_s:.1f} tok/s aggregate")
      if b == 1 and hf_model is not None:
        h = hf.hf_greedy_generate(hf_model, prompt_ids, new)
        hf_runs.append(h)
        log(f"[{i + 1}/{repeats}] HF transformers B=1: {1e3 / h.decode_tokens_per_s:.1f} ms/token,"
            f" {h.decode_tokens_per_s:.1f} tok/s")

  ref = report.upto_eos(runs[1][-1].tokens[0], model.cfg.eos_id) if 1 in runs else None
  rows = [_specjax_row(b, runs[b], compile_s[b], model, wbytes, gbps, ref) for b in batch_sizes]
  out = {
      "model": str(c.model),
      "source": str(model.source),
      "dtype": model.cfg.dtype,
      "prompt_tokens": len(prompt_ids),
      "max_new_tokens": new,
      "repeats": repeats,
      "bandwidth": bw,
      "weight_bytes": wbytes,
      "roofline_ms_per_step": floor,
      "specjax": rows,
      "hf": None,
      "speedup_vs_hf": None,
      "greedy_match": None,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }
  if hf_runs:
    hf_tps = [h.decode_tokens_per_s for h in hf_runs]
    sj_tps = [r.decode_tokens_per_s for r in runs[1]]
    out["hf"] = {
        "impl": "hf-transformers",
        "batch_size": 1,
        "new_tokens": len(hf_runs[-1].tokens),
        "ms_per_step": spread([1e3 / t for t in hf_tps]),
        "tokens_per_s": spread(hf_tps),
        "prefill_s": spread([h.prefill_s for h in hf_runs]),
        "roofline_ratio": (1e3 / statistics.median(hf_tps)) / floor,
        "settings": hf.settings(hf_model),
    }
    out["speedup_vs_hf"] = {
        "median_of_ratios": statistics.median(s / h for s, h in zip(sj_tps, hf_tps)),
        "ratio_of_medians": statistics.median(sj_tps) / statistics.median(hf_tps),
        "per_repeat": [s / h for s, h in zip(sj_tps, hf_tps)],
    }
    out["greedy_match"] = compare_greedy(runs[1][-1].tokens[0], hf_runs[-1].tokens,
                                         model.cfg.eos_id)
  out["peak_rss_mb"] = runner.peak_rss_mb()
  out["runtime_s"] = time.perf_counter() - t_start
  return out


def _iqr(s: dict, fmt: str = "{:.1f}") -> str:
  return f"{fmt.format(s['median'])} [{fmt.format(s['q1'])}-{fmt.format(s['q3'])}]"


def format_table(out: dict) -> str:
  """The benchmark as a markdown table plus a few summary lines."""
  h, speed = out["hf"], out["speedup_vs_hf"]
  head = ["impl", "B", "decode ms/step, median [IQR]", "tok/s per row", "tok/s aggregate",
          "roofline ms/step (weights / +KV)", "measured / roofline"] + (["tok/s vs HF"] if h else [])
  table = [head, ["---"] * len(head)]
  for r in out["specjax"]:
    table.append(["specjax", r["batch_size"], _iqr(r["ms_per_step"]),
                  _iqr(r["tokens_per_s_per_row"]), _iqr(r["tokens_per_s_aggregate"]),
                  f"{r['roofline_ms_per_step']:.3g} / {r['roofline_with_kv_ms_per_step']:.3g}",
                  f"{r['roofline_ratio']:.2f}x"])
    if h:
      table[-1].append(f"{speed['median_of_ratios']:.2f}x" if r["batch_size"] == 1 else "")
  if h:
    table.append(["HF transformers", 1, _iqr(h["ms_per_step"]), _iqr(h["tokens_per_s"]),
                  _iqr(h["tokens_per_s"]), f"{out['roofline_ms_per_step']:.3g}",
                  f"{h['roofline_ratio']:.2f}x", "1.00x"])
  lines = ["| " + " | ".join(str(x) for x in row) + " |" for row in table]
  bw = out["bandwidth"]
  lines += [
      "",
      f"model {out['model']} ({out['dtype']}), prompt {out['prompt_tokens']} tokens, "
      f"max_new_tokens {out['max_new_tokens']}, {out['repeats']} timed repeats; "
      f"decode rates exclude the first token (prefill).",
      f"weights {out['weight_bytes'] / 1e6:.1f} MB; read bandwidth best {bw['best_gbps']:.1f} GB/s, "
      f"median {bw['median_gbps']:.1f} GB/s ({bw['bytes'] / 2**30:.2f} GiB jitted sum); "
      f"roofline {out['roofline_ms_per_step']:.3g} ms/step = "
      f"{1e3 / out['roofline_ms_per_step']:.3g} tok/s per row.",
  ]
  for r in out["specjax"]:
    lines.append(f"specjax B={r['batch_size']}: prefill {_iqr(r['prefill_s'], '{:.3f}')} s, compile run "
                 f"{r['compile_run_s']:.1f} s, {r['decode_steps']} decode steps"
                 + ("" if r["rows_match_b1"] is None else
                    f", rows identical to B=1: {r['rows_match_b1']}"))
  if h:
    g = out["greedy_match"]
    s = h["settings"]
    lines += [
        f"HF: prefill {_iqr(h['prefill_s'], '{:.3f}')} s; torch {s['torch']}, transformers "
        f"{s['transformers']}, {s['threads']} threads, {s['dtype']}, inference_mode; "
        f"speedup specjax/HF: median of per-repeat ratios {speed['median_of_ratios']:.2f}x, "
        f"ratio of medians {speed['ratio_of_medians']:.2f}x.",
        f"greedy outputs identical up to EOS: {g['identical_up_to_eos']} (specjax {g['specjax_tokens']}"
        f" tokens, HF {g['hf_tokens']}" +
        ("" if g["first_mismatch"] is None else f", first mismatch at {g['first_mismatch']}") + ").",
    ]
  lines.append(f"peak RSS {out['peak_rss_mb']:.0f} MB; benchmark wall time {out['runtime_s']:.0f} s.")
  return "\n".join(lines)
