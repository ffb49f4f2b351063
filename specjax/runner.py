"""Config-driven runs behind the experiment mains (which only parse flags).

Configs are ml_collections ConfigDicts; they are turned into the library's
frozen dataclasses here, at the boundary.
"""

from __future__ import annotations

import resource
import statistics
from typing import Optional

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive
from specjax.io.load import Model, load_model


def sampling_from_config(c) -> sampling_lib.SamplingConfig:
  return sampling_lib.SamplingConfig(temperature=float(c.temperature), top_k=int(c.top_k),
                                     top_p=float(c.top_p))


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def generate_from_config(c, model: Optional[Model] = None) -> dict:
  """Run a chat prompt through the configured method; returns text and metrics."""
  sampling = sampling_from_config(c)
  if c.method != "ar":
    raise ValueError(f"unknown method {c.method!r}; available: ar")
  model = model or load_model(c.model, c.dtype)
  if model.tokenizer is None:
    raise ValueError(f"model {c.model!r} has no tokenizer to encode the prompt")
  prompt = model.tokenizer.encode_prompt(c.prompt, system=c.system)
  prompts = [prompt] * int(c.batch_size)
  runs = []
  for _ in range(1 + int(c.repeats)):  # the first run compiles
    runs.append(autoregressive.generate(model.params, model.cfg, prompts, key=int(c.seed),
                                        sampling=sampling, max_new_tokens=int(c.max_new_tokens),
                                        cache_slots=c.cache_slots))
  timed = runs[1:] or runs
  result = timed[-1]
  tps = [r.decode_tokens_per_s for r in timed]
  return {
      "method": c.method,
      "answer": model.tokenizer.decode(result.tokens[0], skip_special_tokens=True),
      "prompt_tokens": len(prompt),
      "new_tokens": result.num_new_tokens,
      "batch_size": len(prompts),
      "tokens_per_s": statistics.median(tps),
      "ms_per_token": 1e3 / statistics.median(tps),
      "time_to_first_token_s": statistics.median(r.prefill_s for r in timed),
      "compile_and_first_run_s": runs[0].prefill_s + runs[0].decode_s,
      "dtype": model.cfg.dtype,
      "temperature": sampling.temperature,
      "top_k": sampling.top_k,
      "top_p": sampling.top_p,
      "peak_rss_mb": peak_rss_mb(),
  }
