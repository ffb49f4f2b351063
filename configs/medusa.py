"""Train Medusa heads (also used by blockwise parallel decoding) on SmolLM2.

  python experiments/train.py --config=configs/medusa.py
  python experiments/train.py --config=configs/medusa.py:tiny   # seconds, tests

Self-distillation data is generated (and resumed) at `data_path` (default
`workdir`/distill.jsonl); training resumes from `workdir`; the best heads
(by the teacher-forced tau estimate on the validation split) are exported
to `export` with a card and the target's fingerprint.
"""

import os

import ml_collections

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"
  # data
  c.sources = "alpaca,code_alpaca,gpteacher_code,gsm8k_train"
  c.num_examples = 600
  c.max_new_tokens = 192
  c.max_prompt_tokens = 192
  c.gen_batch_size = 8
  c.sample_fraction = 0.25
  c.valid_fraction = 0.05
  c.data_path = ""
  c.seed = 0
  # features
  c.seq_len = 384
  c.feature_batch = 4
  # heads and training
  c.num_heads = 4
  c.decay = 0.8
  c.steps = 1500
  c.batch_positions = 128
  c.lr = 1e-3
  c.warmup = 50
  c.weight_decay = 0.0
  c.clip = 1.0
  c.eval_every = 250
  c.save_every = 250
  c.log_every = 25
  c.valid_max_positions = 4096
  c.workdir = "/tmp/specjax_train/medusa"
  c.export = os.path.join(_REPO, "specjax", "checkpoints", "smollm2-135m", "medusa")
  if arg == "tiny":  # a tiny random target, trained in seconds (tests)
    c.update(dict(model="tiny", num_examples=24, max_new_tokens=24, seq_len=48,
                  feature_batch=8, num_heads=3, steps=40, batch_positions=64, lr=3e-3,
                  warmup=5, eval_every=20, save_every=10, log_every=10, valid_fraction=0.2,
                  workdir="/tmp/specjax_train/medusa_tiny", export=""))
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/medusa.py (known: tiny)")
  return c
