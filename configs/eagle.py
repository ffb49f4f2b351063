"""Train an EAGLE head (or, with configs/eagle3.py, an EAGLE-3 head) on SmolLM2.

  python experiments/train.py --config=configs/eagle.py
  python experiments/train.py --config=configs/eagle.py:reduced   # 8192-token draft vocab
  python experiments/train.py --config=configs/eagle.py:reduced_init   # its layer from the target's last
  python experiments/train.py --config=configs/eagle.py:reduced_nocode  # trained without the code sources
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_rr  # + prefixes round-robin over the sources
  python experiments/train.py --config=configs/eagle.py:reduced_wd  # (or reduced_nocode_wd) + weight decay 0.1
  python experiments/train.py --config=configs/eagle.py:reduced_dropout  # + feature dropout 0.1
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_seq  # (or reduced_seq) + loss on prompt positions
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_seq_ref  # + 2,400 datasets' reference answers
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_seq_ref8k  # + 8,000 of them
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_seq_ref8k_grown  # + the rest of the data, whole XSum documents
  python experiments/train.py --config=configs/eagle.py:reduced_nocode_seq_ref_l2  # any variant + _l2: a 2-layer head
  python experiments/train.py --config=configs/eagle.py:tiny      # seconds, tests

Self-distillation data is generated (and resumed) at `data_path` (default
`workdir`/distill.jsonl; num_examples=0 trains on what the file holds);
training resumes from `workdir`; the best head (by the teacher-forced tau
estimate of a k=`eval_k` chain on the validation split) is exported to
`export` with a card and the target's fingerprint.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(arg=None, method="eagle"):
  # The fields (specjax.training.settings.TrainSettings): the shared ones and
  # EAGLE's (draft_vocab, ttt_steps, w_reg, w_cls, noise, decay, teacher_top_k, context,
  # batch_tokens, window, batch_windows, eval_k, valid_max_windows): whole
  # sequences from position 0 by default. EAGLE-3 unrolls 3 steps (the
  # training-time test) with the classification loss at full weight.
  # The shipped head is the reduced-vocabulary one (`:reduced`); a full-vocabulary
  # run exports beside it.
  shipped = os.path.join(_REPO, "specjax", "checkpoints", "smollm2-135m", method)
  # teacher_top_k=128: the stored top-128 teacher distributions cover 0.988 of
  # the labels' mass on SmolLM2's own answers (64: 0.980) and halve a step.
  c = common.training_config(method, gen_batch_size=16, steps=2000, warmup=100,
                             teacher_top_k=128,
                             workdir=f"/tmp/specjax_train/{method}", export=shipped + "_full",
                             **(dict(ttt_steps=3, w_cls=1.0) if method == "eagle3" else {}))
  if arg == "tiny":  # a tiny random target, trained in seconds (tests)
    c.update(dict(model="tiny", teacher_top_k=0, num_examples=24, max_new_tokens=24, seq_len=48,
                  feature_batch=8, batch_tokens=256, window=16, batch_windows=8, steps=40,
                  lr=3e-3, warmup=5,
                  eval_every=20, save_every=10, log_every=10, valid_fraction=0.2, eval_k=3,
                  valid_max_windows=16, workdir=f"/tmp/specjax_train/{method}_tiny", export=""))
  elif arg == "reduced":
    c.update(dict(draft_vocab=8192, workdir=f"/tmp/specjax_train/{method}_v8k", export=shipped))
  elif arg == "reduced_init":  # the reduced head, its layer started as the target's last
    c = get_config("reduced", method)
    c.update(dict(head_init_layer=-1, workdir=f"/tmp/specjax_train/{method}_v8k_init",
                  export=shipped + "_init"))
  elif arg == "reduced_nocode":  # the reduced head on a data mix without code (Spec-Bench has none)
    c = get_config("reduced", method)
    c.update(dict(train_sources="alpaca,gsm8k_train,xsum",
                  workdir=f"/tmp/specjax_train/{method}_v8k_nocode", export=shipped + "_nocode"))
  elif arg == "reduced_nocode_rr":  # no code; a train_positions prefix takes the
    # sources in turn (each in file order), so XSum, last in the file, is in every prefix
    c = get_config("reduced_nocode", method)
    c.update(dict(train_order="sources", workdir=c.workdir + "_rr", export=c.export + "_rr"))
  elif arg in ("reduced_wd", "reduced_nocode_wd"):  # + AdamW weight decay 0.1
    c = get_config(arg[:-3], method)
    c.update(dict(weight_decay=0.1, workdir=c.workdir + "_wd", export=c.export + "_wd"))
  elif arg in ("reduced_seq", "reduced_nocode_seq"):  # + the loss on the prompt's positions too
    c = get_config(arg[:-4], method)
    c.update(dict(loss_positions="sequence", workdir=c.workdir + "_seq", export=c.export + "_seq"))
  elif arg == "reduced_nocode_seq_ref":  # + 2,400 datasets' reference answers (teacher-forced)
    c = get_config("reduced_nocode_seq", method)
    c.update(dict(reference_examples=2400, workdir=c.workdir + "_ref", export=c.export + "_ref"))
  elif arg == "reduced_nocode_seq_ref8k":  # 8,000 reference answers (the first 2,400 as above)
    c = get_config("reduced_nocode_seq", method)
    c.update(dict(reference_examples=8000, workdir=c.workdir + "_ref8k",
                  export=c.export + "_ref8k"))
  elif arg == "reduced_nocode_seq_ref8k_grown":  # the shipped head's data (46,000
    # self-distilled answer positions, 8,000 reference answers, the scaling work's
    # validation ids) grown by the rest of the data file's self-distilled answers
    # (no code) and up to 1,000 whole XSum documents (prompts up to 1,024 tokens)
    # with their reference summaries, appended (the shipped head's feature shards
    # are reused); grown sequences over 384 tokens whole, in shards at 1,280;
    # length buckets drawn by loss positions, so the long prompts are trained on
    # as often as any position
    c = get_config("reduced_nocode_seq_ref8k", method)
    c.update(dict(grow_records=True, long_reference_examples=1000, long_sources="xsum",
                  long_prompt_tokens=1024, long_seq_len=1280, bucket_weight="loss",
                  num_examples=0, train_positions=46000, valid_max_windows=200,
                  train_eval_sequences=200,
                  valid_ids_path=os.path.join(_REPO, "experiments", "results", "scaling",
                                              "valid_ids.json"),
                  workdir=c.workdir[:-len("_ref8k")] + "_ref8k_grown",
                  export=c.export + "_grown"))
  elif arg == "reduced_distill":  # the self-distilled data file's 300,000-answer-token
    # prefix without the scaling work's 200 validation ids (the curve's 300,000 point:
    # 1,779 records, code included, 278,665 answer positions within the 384-token
    # sequences), the loss on answers, 4 epochs; the shipped EAGLE head
    c = get_config("reduced", method)
    c.update(dict(num_examples=0, train_positions=300_000, epochs=4.0, patience=10,
                  eval_every=100, save_every=100, valid_max_windows=200,
                  train_eval_sequences=200,
                  valid_ids_path=os.path.join(_REPO, "experiments", "results", "scaling",
                                              "valid_ids.json"),
                  workdir=c.workdir + "_distill"))
  elif arg == "reduced_dropout":  # + dropout 0.1 on the fused target features
    c = get_config("reduced", method)
    c.update(dict(feature_dropout=0.1, workdir=c.workdir + "_drop", export=c.export + "_drop"))
  elif arg and arg.endswith("_l2"):  # the variant with a 2-layer head
    c = get_config(arg[:-3], method)
    c.update(dict(head_layers=2, workdir=c.workdir + "_l2",
                  export=(c.export + "_l2") if c.export else ""))
  elif arg == "tiny_reduced":
    c = get_config("tiny", method)
    c.draft_vocab, c.teacher_top_k = 32, 16
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/{method}.py "
                     "(known: tiny, reduced, reduced_init, reduced_nocode, reduced_nocode_rr, reduced_wd, reduced_nocode_wd, "
                     "reduced_seq, reduced_nocode_seq, reduced_nocode_seq_ref, reduced_nocode_seq_ref8k, "
                     "reduced_nocode_seq_ref8k_grown, reduced_distill, "
                     "reduced_dropout, tiny_reduced; any of them + _l2: a 2-layer head)")
  return c
