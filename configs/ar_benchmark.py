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

import ml_collections

from specjax.peers import hf


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"
  # A prompt the model answers at length, so every run decodes max_new_tokens.
  c.prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."
  c.system = ml_collections.config_dict.placeholder(str)
  c.max_new_tokens = 128
  c.batch_sizes = (1, 4, 16)  # the prompt repeated B times
  c.repeats = 5  # timed runs per configuration, after a compile / warm-up run
  c.peers = hf.available()  # HF transformers side by side (the `peers` extra)
  c.bandwidth_gib = 1.0  # size of the read-bandwidth probe
  c.out = ml_collections.config_dict.placeholder(str)  # JSON results path
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
