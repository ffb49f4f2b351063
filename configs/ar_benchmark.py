"""The foundation benchmark: specjax autoregressive greedy decoding vs the
memory roofline and HF transformers, on SmolLM2-135M-Instruct.

Usage:
  python experiments/ar_benchmark.py --config=configs/ar_benchmark.py
  python experiments/ar_benchmark.py --config=configs/ar_benchmark.py:quick
  python experiments/ar_benchmark.py --config=configs/ar_benchmark.py \
      --config.batch_sizes="(1, 8)" --config.out=/tmp/ar.json

Variants (the text after ':'), combinable with '+' (e.g. `quick+nopeers`):
  quick    16 new tokens, B=1 only, 2 repeats, 0.25 GiB bandwidth probe
  bf16     bfloat16 weights and cache
  nopeers  skip HF transformers
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import ar

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.ar.ARBenchmarkSettings
  # (model, dtype, prompt, system, max_new_tokens, batch_sizes, repeats, peers
  # (whether the `peers` extra is installed), bandwidth_gib, out).
  common.settings_fields(c, ar.ARBenchmarkSettings)
  for variant in (arg or "").split("+"):
    if not variant:
      continue
    if variant == "quick":
      c.max_new_tokens, c.batch_sizes, c.repeats, c.bandwidth_gib = 16, (1,), 2, 0.25
    elif variant == "bf16":
      c.dtype = "bfloat16"
    elif variant == "nopeers":
      c.peers = False
    else:
      raise ValueError(f"unknown variant {variant!r} of configs/ar_benchmark.py "
                       "(quick, bf16, nopeers)")
  c.lock()
  return c
