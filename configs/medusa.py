"""Train Medusa heads (also used by blockwise parallel decoding) on SmolLM2.

  python experiments/train.py --config=configs/medusa.py
  python experiments/train.py --config=configs/medusa.py:tiny   # seconds, tests

Self-distillation data is generated (and resumed) at `data_path` (default
`workdir`/distill.jsonl); training resumes from `workdir`; the best heads
(by the teacher-forced tau estimate on the validation split) are exported
to `export` with a card and the target's fingerprint.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(arg=None):
  # the fields (specjax.training.settings.TrainSettings): the shared ones and
  # Medusa's (num_heads, decay, batch_positions, valid_max_positions)
  c = common.training_config(
      "medusa", export=os.path.join(_REPO, "specjax", "checkpoints", "smollm2-135m", "medusa"))
  if arg == "tiny":  # a tiny random target, trained in seconds (tests)
    c.update(dict(model="tiny", num_examples=24, max_new_tokens=24, seq_len=48,
                  feature_batch=8, num_heads=3, steps=40, batch_positions=64, lr=3e-3,
                  warmup=5, eval_every=20, save_every=10, log_every=10, valid_fraction=0.2,
                  workdir="/tmp/specjax_train/medusa_tiny", export=""))
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/medusa.py (known: tiny)")
  return c
