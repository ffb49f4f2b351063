"""Self-distillation answer throughput: static batches vs continuous batching,
float32 vs bfloat16, and the peers (HF transformers, llama.cpp) on the same
GGUF file, on the training prompts (specjax.benchmarks.datagen).

  python experiments/datagen.py --config=configs/datagen.py
  python experiments/datagen.py --config=configs/datagen.py:quick
  python experiments/datagen.py --config=configs/datagen.py --config.ways=static,continuous,hf,llamacpp
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import datagen

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.datagen.DatagenSettings
  # (model, sources, num_prompts, max_prompt_tokens, max_new_tokens, batch_size,
  # dtypes, ways, hf_dtype, repeats, seed, out). ways: of static, continuous
  # (specjax, in each of dtypes), hf (the `peers` extra), llamacpp (optional).
  common.settings_fields(c, datagen.DatagenSettings)
  if arg == "quick":
    c.num_prompts, c.max_new_tokens, c.batch_size, c.repeats = 16, 64, 8, 1
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/datagen.py (known: quick)")
  c.lock()
  return c
