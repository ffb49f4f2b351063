"""A data-scaling curve of EAGLE-3 on SmolLM2 (specjax/benchmarks/scaling.py):
the recipe of configs/eagle3.py:reduced trained on nested subsets of the
self-distilled data, each to its early stop, then measured on Spec-Bench.

  python experiments/scaling.py --config=configs/scaling.py \
      --config.data_path=/path/distill.jsonl --config.out=/tmp/scaling
  python experiments/scaling.py --config=configs/scaling.py \
      --config.data_path=... --config.sizes=46000,100000 --config.seeds=1   # what the data holds

The data comes from experiments/distill.py (resumable); sizes the data cannot
hold yet are left out and run when the command is repeated on grown data.
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import scaling

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.scaling.ScalingSettings
  # (data_path, sizes, seeds, seeds_below, valid_sequences, train_eval_sequences,
  # epochs, patience, eval_every, eval_k, bench_k, bench_prompt_limit,
  # bench_max_new_tokens, bench_prompts, out). The training recipe: configs/eagle3.py's
  # variant `recipe` (its other fields are set per point).
  common.settings_fields(c, scaling.ScalingSettings)
  c.recipe = "reduced"  # a variant of configs/eagle3.py (e.g. reduced_init)
  if arg:
    raise ValueError(f"unknown variant {arg!r} of configs/scaling.py")
  c.lock()
  return c
