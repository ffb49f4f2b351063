"""An EAGLE / EAGLE-3 head's teacher-forced estimate against decoding, on the
same held-out text.

For greedy self-distilled records (the target's own greedy answers) teacher
forcing reproduces every prefix greedy decoding visits, so the walk of
`theory.greedy_rounds` (`tau_rounds`) must equal the tau that decoding the
record's prompt measures, if the head drafts as it was trained; the mean over
every chain start (`tau`) is the estimate training keeps its best by. Prints
both estimates and the measured tau per record and overall, and whether each
decoded answer equals the stored one.

  gunzip -c experiments/data/smollm2_distill_v1.jsonl.gz > /tmp/distill_full.jsonl
  python experiments/estimate_vs_measured.py --data_path=/tmp/distill_full.jsonl --records=12
"""

import json

from absl import app
from absl import flags
from absl import logging

_DATA = flags.DEFINE_string("data_path", "", "Self-distillation JSONL (experiments/distill.py).")
_VALID = flags.DEFINE_string("valid_ids", "experiments/results/scaling/valid_ids.json",
                             "JSON list of held-out record ids (the scaling work's 200).")
_METHOD = flags.DEFINE_enum("method", "eagle3", ["eagle", "eagle3"], "The head's method.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "Exported head ('': the shipped one).")
_RECORDS = flags.DEFINE_integer("records", 12, "Greedy held-out records to compare on.")
_SOURCES = flags.DEFINE_list("sources", ["alpaca", "gsm8k_train", "xsum"],
                             "Sources the records are taken from, in the file's order.")
_K = flags.DEFINE_integer("k", 4, "Chain length.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Target precision (the records were generated in float32).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 192, "Longest prompt taken.")
_MIN_ANSWER = flags.DEFINE_integer("min_answer_tokens", 40, "Shortest answer taken.")


def main(argv):
  del argv
  if not _DATA.value:
    raise app.UsageError("--data_path=<distill.jsonl> is required")
  logging.set_verbosity(logging.WARNING)
  # pylint: disable=import-outside-toplevel
  from specjax import sampling as sampling_lib
  from specjax.decoding import speculative as sp
  from specjax.drafters import eagle, registry
  from specjax.io import checkpoints
  from specjax.io.load import load_model
  from specjax.training import distill_data, eagle_train
  # pylint: enable=import-outside-toplevel
  with open(_VALID.value) as f:
    valid = set(json.load(f))
  recs = [r for r in distill_data.read_records(_DATA.value)
          if r["id"] in valid and r["sampling"]["temperature"] == 0.0
          and distill_data.source_of(r["id"]) in _SOURCES.value
          and len(r["prompt"]) <= _MAX_PROMPT.value and len(r["answer"]) >= _MIN_ANSWER.value]
  recs = recs[:_RECORDS.value]
  if not recs:
    raise app.UsageError("no greedy held-out record matches the filters")
  model = load_model("smollm2-135m", _DTYPE.value, batch_invariant=False)
  cfg, k = model.cfg, _K.value
  method = _METHOD.value + (f"@checkpoint={_CHECKPOINT.value}" if _CHECKPOINT.value else "")
  path = _CHECKPOINT.value or registry.shipped_checkpoint(_METHOD.value)
  params, _ = checkpoints.load_drafter(path, model.params, cfg, method=_METHOD.value)
  head = {n: v for n, v in params.items() if n not in ("vocab", "vocab_rank")}
  taps = eagle.eagle3_layers(cfg) if _METHOD.value == "eagle3" else ()
  pool = eagle_train.SeqPool.build(model.params, cfg, distill_data.sequences(recs),
                                   seq_len=max(len(r["prompt"]) + len(r["answer"]) for r in recs),
                                   taps=taps)
  windows = pool.eval_sequences()
  drafter, dparams = registry.make_drafter(f"{method}@k={k}", {}, model,
                                           sampling=sampling_lib.GREEDY)
  tokens = rounds = same = 0
  for r, w in zip(recs, windows):
    est = eagle_train.estimate(head, model.params, cfg, [w], k, params.get("vocab"))
    res = sp.generate(model.params, cfg, drafter, [r["prompt"]], draft_params=dparams,
                      max_new_tokens=len(r["answer"]))
    tokens, rounds = tokens + res.stats["emitted"], rounds + res.stats["rounds"]
    same += res.tokens[0] == r["answer"]
    print(json.dumps({"id": r["id"], "tau": round(est["tau"], 3),
                      "tau_rounds": round(est["tau_rounds"], 3),
                      "measured": round(res.stats["emitted"] / res.stats["rounds"], 3),
                      "identical": res.tokens[0] == r["answer"]}), flush=True)
  est = eagle_train.estimate(head, model.params, cfg, windows, k, params.get("vocab"))
  print(json.dumps({"records": len(recs), "tau": est["tau"], "tau_rounds": est["tau_rounds"],
                    "measured": tokens / rounds, "identical": same,
                    "rel_error_tau": est["tau"] / (tokens / rounds) - 1,
                    "rel_error_tau_rounds": est["tau_rounds"] / (tokens / rounds) - 1}))


if __name__ == "__main__":
  app.run(main)
