"""The Spec-Bench protocol: speculative methods against the AR baseline, per category.

Usage:
  python experiments/benchmark.py --config=configs/benchmark.py \
      --config.methods=prompt_lookup,layer_skip,replay --config.prompt_limit=2
  python experiments/benchmark.py --config=configs/benchmark.py:sample --config.out=/tmp/b

Variants (the text after ':'), combinable with '+':
  sample  temperature 0.7, top-p 0.9
  bf16    bfloat16 weights and cache

Any JSONL file in Spec-Bench's format works (--config.prompts=...). A run
resumes from `out`/log.jsonl; change `out` when changing the settings.
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import specbench

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.specbench.BenchmarkSettings
  # (model, dtype, batch_invariant, invariant_tile, prompts (Spec-Bench), methods, prompt_limit,
  # max_new_tokens, batch_size, seed, repeats, out, processes, local_devices,
  # calibrate, mesh, temperature / top_k / top_p), and the drafters' (None: the
  # method's default).
  common.settings_fields(c, specbench.BenchmarkSettings)
  common.apply_variants(c, arg, "configs/benchmark.py")
  c.lock()
  return c
