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

from specjax import runner

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # A generate run's fields, one default each: specjax.runner.GenerateSettings
  # (model, dtype, batch_invariant, invariant_tile, prompt, system, max_new_tokens, batch_size,
  # seed, cache_slots, repeats, method, mesh, temperature / top_k / top_p), and
  # the drafter's (read by the method that uses them; None: the method's default).
  common.settings_fields(c, runner.GenerateSettings)
  common.apply_variants(c, arg, "configs/smollm2.py")
  c.lock()
  return c
