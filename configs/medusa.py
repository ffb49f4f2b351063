"""Train Medusa heads (also used by blockwise parallel decoding) on SmolLM2.

  python experiments/train.py --config=configs/medusa.py
  python experiments/train.py --config=configs/medusa.py:tiny   # seconds, tests
  python experiments/train.py --config=configs/medusa.py:reduced_distill  # every self-distilled answer
  python experiments/train.py --config=configs/medusa.py:reduced_ref8k  # the shipped EAGLE-3 head's data

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
  # Medusa's (num_heads, decay, batch_positions, valid_max_positions,
  # draft_vocab, teacher_top_k)
  c = common.training_config(
      "medusa", export=os.path.join(_REPO, "specjax", "checkpoints", "smollm2-135m", "medusa"))
  if arg == "tiny":  # a tiny random target, trained in seconds (tests)
    c.update(dict(model="tiny", num_examples=24, max_new_tokens=24, seq_len=48,
                  feature_batch=8, num_heads=3, steps=40, batch_positions=64, lr=3e-3,
                  warmup=5, eval_every=20, save_every=10, log_every=10, valid_fraction=0.2,
                  workdir="/tmp/specjax_train/medusa_tiny", export=""))
  elif arg == "tiny_reduced":  # + a reduced draft vocabulary and the top-K teacher
    c = get_config("tiny")
    c.update(dict(draft_vocab=32, teacher_top_k=16, lr=1e-2))
  elif arg == "reduced_ref8k":  # the recipe below on the data of the EAGLE-3 head's first
    # stage (configs/eagle3.py:reduced_nocode_seq_ref8k: 257 self-distilled records
    # without code + 8,000 datasets' reference answers; its feature shards serve), 2 epochs
    c = get_config("reduced_distill")
    c.update(dict(train_sources="alpaca,gsm8k_train,xsum", train_positions=46000,
                  reference_examples=8000, epochs=2.0, eval_every=500,
                  workdir="/tmp/specjax_train/medusa_v8k_ref8k",
                  export=c.export[:-len("_distill")] + "_ref8k"))
  elif arg == "reduced_distill":  # the target's own answers only: every self-distilled
    # record of the data file (all sources) but the scaling work's validation ids
    # (the draft model's `:distill` data; its feature shards serve), an 8192-token
    # draft vocabulary, soft labels from the stored top-128 teacher, 3 epochs.
    # A head reads only h_t: on the target's own text x_{t+1} is the argmax h_t
    # encodes, on reference answers it is not (`:reduced_ref8k` trains worse)
    c.update(dict(num_examples=0, train_positions=0, reference_examples=0,
                  valid_ids_path=os.path.join(_REPO, "experiments", "results", "scaling",
                                              "valid_ids.json"),
                  draft_vocab=8192, teacher_top_k=128, epochs=3.0, batch_positions=512,
                  lr=1e-3, warmup=100, valid_max_positions=16384, eval_every=250,
                  save_every=250, workdir="/tmp/specjax_train/medusa_v8k_distill",
                  export=c.export + "_distill"))
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/medusa.py "
                     "(known: tiny, tiny_reduced, reduced_ref8k, reduced_distill)")
  return c
