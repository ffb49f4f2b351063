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

import importlib.util
import os

import ml_collections

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"
  # decode forwards bit for bit independent of the block (specjax.models.invariant):
  # greedy speculative output equals greedy AR token for token; slower
  c.batch_invariant = False
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
  common.drafter_fields(c)
  common.apply_variants(c, arg, "configs/smollm2.py")
  c.lock()
  return c
