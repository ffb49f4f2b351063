"""Distil a small independent draft model from SmolLM2 (DistillSpec-style).

  python experiments/train.py --config=configs/draft_model.py
  python experiments/train.py --config=configs/draft_model.py:full   # full-vocabulary drafting
  python experiments/train.py --config=configs/draft_model.py:ref8k  # on the EAGLE-3 head's data
  python experiments/train.py --config=configs/draft_model.py:distill  # every self-distilled answer
  python experiments/train.py --config=configs/draft_model.py:tiny   # seconds, tests

The student has the target's width and tokenizer and `draft_layers` decoder
layers initialised from the target's `init_layers` (default: its first
draft_layers); its embedding and LM head are the target's,
frozen and referenced by the checkpoint. Trained on the same self-distillation
data as the heads (`data_path`, + `reference_examples` of the datasets' own
answers) with `loss` = kl | tv | kl+tv against the target's T = 1
distributions; the best student by the teacher-forced tau estimate is exported
to `export`. `python experiments/export.py --config.checkpoint=<export>`
writes it as a standalone HF-format model (full embedding).
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(arg=None):
  # The fields (specjax.training.settings.TrainSettings): the shared ones and
  # the draft model's (draft_layers, init_layers, loss, draft_vocab, batch_seqs,
  # eval_k, valid_max_seqs, store_dtype: 4 SmolLM2 layers are 57 MB in float32,
  # the shipped weights are stored in bfloat16). It drafts from an 8192-token
  # vocabulary by default (`:full`: the full one).
  c = common.training_config(
      "draft_model", steps=1000, lr=5e-4, draft_vocab=8192,
      workdir="/tmp/specjax_train/draft_model",
      export=os.path.join(_REPO, "specjax", "checkpoints", "smollm2-135m", "draft_model"))
  if arg == "tiny":  # a tiny random target, trained in seconds (tests)
    c.update(dict(model="tiny", num_examples=24, max_new_tokens=24, seq_len=64,
                  feature_batch=8, draft_layers=1, steps=40, lr=3e-3, warmup=5,
                  eval_every=20, save_every=10, log_every=10, valid_fraction=0.2, eval_k=3,
                  draft_vocab=0, store_dtype="float32", valid_max_seqs=8,
                  workdir="/tmp/specjax_train/draft_model_tiny", export=""))
  elif arg == "tiny_reduced":
    c = get_config("tiny")
    c.draft_vocab = 32
  elif arg == "ref8k":  # the shipped EAGLE-3 head's data (configs/eagle.py:reduced_nocode_seq_ref8k):
    # the self-distilled answers without code sources + 8,000 datasets' reference
    # answers, the fixed validation ids of the scaling work, the stored top-128
    # teacher (its features are the EAGLE-3 run's shards), loss on every position
    # after the chat template's shared head, 1 epoch
    c.update(dict(train_sources="alpaca,gsm8k_train,xsum", train_positions=46000,
                  reference_examples=8000, num_examples=0,
                  valid_ids_path=os.path.join(_REPO, "experiments", "results", "scaling",
                                              "valid_ids.json"),
                  teacher_top_k=128, loss_positions="sequence", epochs=1.0,
                  warmup=100, valid_max_seqs=200, eval_every=250, save_every=250,
                  workdir="/tmp/specjax_train/draft_model_ref8k", export=c.export + "_ref8k"))
  elif arg == "distill":  # every self-distilled answer of the data file (all sources; the
    # scaling work's validation ids held out), the loss on answers only, the
    # stored top-128 teacher, 2 epochs: the target's own text, what drafting meets
    c.update(dict(num_examples=0, train_positions=0, reference_examples=0,
                  valid_ids_path=os.path.join(_REPO, "experiments", "results", "scaling",
                                              "valid_ids.json"),
                  teacher_top_k=128, loss_positions="answer", epochs=2.0, warmup=100,
                  valid_max_seqs=200, eval_every=250, save_every=250,
                  workdir="/tmp/specjax_train/draft_model_distill", export=c.export + "_distill"))
  elif arg == "full":
    c.update(dict(draft_vocab=0, workdir="/tmp/specjax_train/draft_model_full",
                  export=c.export + "_full"))
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/draft_model.py "
                     "(known: tiny, tiny_reduced, ref8k, distill, full)")
  return c
