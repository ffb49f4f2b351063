"""Self-distillation answer throughput: static batches vs continuous batching,
float32 vs bfloat16, on the training prompts (specjax.benchmarks.datagen).

  python experiments/datagen.py --config=configs/datagen.py
  python experiments/datagen.py --config=configs/datagen.py:quick
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.sources = "alpaca,code_alpaca,gpteacher_code,gsm8k_train,xsum"
  c.num_prompts = 64
  c.max_prompt_tokens = 512
  c.max_new_tokens = 256
  c.batch_size = 16
  c.dtypes = "float32,bfloat16"
  c.ways = "static,continuous"
  c.repeats = 2
  c.seed = 0
  c.out = ""  # a folder for results.json / results.md (optional)
  if arg == "quick":
    c.num_prompts, c.max_new_tokens, c.batch_size, c.repeats = 16, 64, 8, 1
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/datagen.py (known: quick)")
  c.lock()
  return c
