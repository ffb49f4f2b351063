"""SmolLM2-135M-Instruct on the CPU: chat generation and decoding metrics.

Usage:
  python experiments/generate.py --config=configs/smollm2.py --config.prompt="..."
  python experiments/generate.py --config=configs/smollm2.py:sample
  python experiments/generate.py --config=configs/smollm2.py:bf16
  python experiments/generate.py --config=configs/smollm2.py --config.method=prompt_lookup --config.k=4

Variants (the text after ':'), combinable with '+' (e.g. `sample+bf16`):
  sample  temperature 0.7, top-p 0.9
  bf16    bfloat16 weights and cache
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"
  c.prompt = "Explain in three sentences why the sky is blue."
  c.system = ml_collections.config_dict.placeholder(str)
  c.max_new_tokens = 128
  c.batch_size = 1  # the prompt is repeated with distinct request ids
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.cache_slots = ml_collections.config_dict.placeholder(int)
  c.repeats = 1  # timed repeats after a compile run
  c.method = "ar"  # or a drafter of specjax.drafters.registry, run against AR interleaved
  # Speculative settings (read by the method that uses them; None: the method's default).
  c.k = 4  # draft length
  c.max_ngram = 3  # prompt_lookup
  c.min_ngram = 1  # prompt_lookup
  c.layers = ml_collections.config_dict.placeholder(str)  # layer_skip, e.g. '0-9'
  c.draft_model = ml_collections.config_dict.placeholder(str)  # draft_model, e.g. 'self:10'
  for variant in (arg or "").split("+"):
    if not variant:
      continue
    if variant == "sample":
      c.temperature, c.top_p = 0.7, 0.9
    elif variant == "bf16":
      c.dtype = "bfloat16"
    else:
      raise ValueError(f"unknown variant {variant!r} of configs/smollm2.py (sample, bf16)")
  c.lock()
  return c
