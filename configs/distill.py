"""Bulk self-distillation data: the target's own answers to the training
prompts, generated with continuous batching and appended (resumable) to one
JSONL file (specjax.training.distill_data).

  python experiments/distill.py --config=configs/distill.py --config.out=/path/distill.jsonl
  python experiments/distill.py --config=configs/distill.py:long --config.out=...   # prompts up to 1024 tokens
  python experiments/distill.py --config=configs/distill.py:quick --config.out=...  # seconds

A killed run is restarted with the same command: ids already in the file are
skipped, a cut-short last line is dropped and regenerated. The `:long` variant
answers the prompts of 257..1024 tokens (XSum articles mostly) that the
default pass skipped, in a batch sized for their longer cache.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"  # the fastest way measured on CPU (configs/datagen.py)
  c.sources = "alpaca,code_alpaca,gpteacher_code,gsm8k_train,xsum"
  c.num_examples = 100_000  # every decontaminated prompt of the sources
  c.seed = 0
  c.max_prompt_tokens = 256
  c.max_new_tokens = 320
  c.batch_size = 32
  c.chunk_steps = 16
  c.block_examples = 512  # generated together, in the sources' interleaved order
  c.sample_fraction = 0.25
  c.temperature = 0.7
  c.top_p = 0.9
  c.valid_fraction = 0.05
  c.out = ""  # the JSONL file (required)
  if arg == "long":
    c.max_prompt_tokens, c.batch_size = 1024, 8
  elif arg == "quick":
    c.num_examples, c.max_new_tokens, c.batch_size, c.max_prompt_tokens = 6, 16, 4, 128
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/distill.py (known: long, quick)")
  c.lock()
  return c
