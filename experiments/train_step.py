"""EAGLE / EAGLE-3 training-step throughput, side by side: the draft LM head
and the loss on the gathered loss positions (`SeqPool.sequence_batch`'s
`loss_rows`, what training runs) against the same on every slot of the
(B, T) batch (prompt and padding positions included), interleaved step by
step in one run, on the same batches.

The batches have the shapes a training run of the config draws: whole
sequences of the data file's first --records records (prompt + answer token
ids, length-bucketed, `batch_tokens` per step), the config's draft
vocabulary, unrolled steps and teacher top-K. The features and teacher
distributions are random numbers: a step's time depends on its shapes, not
on their values, and no feature pass is needed.

  python experiments/train_step.py --config=configs/eagle3.py:reduced \
      --config.data_path=/tmp/distill.jsonl --records=834 --steps=40

Prints, per variant, the median step time, answer positions per second and
their ratio (medians over the same steps; every bucket's program is compiled
before timing).
"""

import json
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from specjax.training.settings import TrainSettings

_CONFIG = config_flags.DEFINE_config_file("config", "configs/eagle3.py:reduced",
                                          "EAGLE / EAGLE-3 training config.")
_RECORDS = flags.DEFINE_integer("records", 834, "The data file's first N records give the "
                                "sequence lengths.")
_STEPS = flags.DEFINE_integer("steps", 40, "Timed steps per variant.")
_OUT = flags.DEFINE_string("out", "", "Write the result (JSON) here too.")


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
  from specjax.training import distill_data  # pylint: disable=import-outside-toplevel
  from specjax.training import eagle_train  # pylint: disable=import-outside-toplevel
  from specjax.training import loop  # pylint: disable=import-outside-toplevel
  from specjax.training import run  # pylint: disable=import-outside-toplevel

  logging.set_verbosity(logging.WARNING)
  c = TrainSettings.of(_CONFIG.value)
  if c.method not in ("eagle", "eagle3"):
    raise app.UsageError(f"--config: an EAGLE or EAGLE-3 training config, not {c.method!r}")
  if not c.data_path:
    raise app.UsageError("--config.data_path: a self-distillation data file (its lengths)")
  if _RECORDS.value < 1 or _STEPS.value < 1:
    raise app.UsageError("--records and --steps must be >= 1")
  if c.context != "sequence":
    raise app.UsageError(f"--config.context={c.context!r}: only whole-sequence batches "
                         "('sequence') gather their loss positions")
  model = run._target(c)  # pylint: disable=protected-access
  cfg = model.cfg
  records = distill_data.read_records(c.data_path)[:_RECORDS.value]
  seqs = [(s[:c.seq_len], min(p, c.seq_len)) for s, p in distill_data.sequences(records)]
  for r, (s, _) in zip(records, seqs):
    if max(s) >= cfg.vocab_size:
      raise app.UsageError(f"record {r['id']}: token id {max(s)} is outside the model's "
                           f"vocabulary ({cfg.vocab_size}); the data belongs to another model")
  fused = c.method == "eagle3"
  taps = eagle.eagle3_layers(cfg) if fused else ()
  rng = np.random.default_rng(0)
  k = c.teacher_top_k or 0
  d = cfg.dim * (len(taps) if taps else 1)

  def rand(n, *shape):
    return rng.standard_normal((n,) + shape).astype(np.float32)

  teacher = {} if not k else {  # the stored top-K teacher the config trains on, if any
      "top_ids": [rng.integers(0, cfg.vocab_size, (len(s), k)).astype(np.int32)
                  for s, _ in seqs],
      "top_p": [np.full((len(s), k), 1.0 / k, np.float32) for s, _ in seqs]}
  pool = eagle_train.SeqPool([np.asarray(s, np.int32) for s, _ in seqs],
                             [rand(len(s), cfg.dim) for s, _ in seqs],
                             [rand(len(s), d) if taps else None for s, _ in seqs],
                             [p for _, p in seqs], **teacher)
  pool.bucket_weight = c.bucket_weight
  if c.loss_positions == "sequence":
    pool.train_on_sequence()
  vocab = run._reduced_vocab(c, cfg, seqs, print)  # pylint: disable=protected-access
  head = eagle.init_head(jax.random.key(c.seed), cfg, fused=fused, num_layers=c.head_layers)
  opt = loop.make_optimizer(c.lr, 1000, c.warmup, c.weight_decay, c.clip)
  step = eagle_train.make_step(opt, model.params, cfg, vocab=vocab, steps=c.ttt_steps,
                               w_reg=0.0 if fused else c.w_reg, w_cls=c.w_cls, decay=c.decay,
                               noise=0.0 if fused else c.noise)
  opt_state = opt.init(head)

  def batches(n, seed):
    r = np.random.default_rng(seed)
    out = []
    for i in range(n):
      b = pool.sequence_batch(r, c.batch_tokens)
      b["key"] = np.asarray(jax.random.key_data(jax.random.key(i)))
      out.append(b)
    return out

  def whole(b):
    return {name: v for name, v in b.items() if not name.startswith("loss_rows")}

  def run_step(b):
    t0 = time.perf_counter()
    h, _, m = step(head, opt_state, {name: jnp.asarray(v) for name, v in b.items()})
    jax.block_until_ready((h, m))
    return time.perf_counter() - t0

  # compile every bucket's program of both variants before timing
  widths = {}
  for b in batches(400, 1):
    widths.setdefault(b["tokens"].shape, b)
  for b in widths.values():
    run_step(b)
    run_step(whole(b))
  timed = batches(_STEPS.value, 2)
  gathered, full, answers = [], [], []
  for i, b in enumerate(timed):  # interleaved, the order alternating
    pair = (b, whole(b)) if i % 2 == 0 else (whole(b), b)
    t = [run_step(x) for x in pair]
    gathered.append(t[0] if i % 2 == 0 else t[1])
    full.append(t[1] if i % 2 == 0 else t[0])
    answers.append(float(np.sum(b["answer"])))
  g, f = np.asarray(gathered), np.asarray(full)
  slots = float(np.mean([b["tokens"].size for b in timed]))
  rows = float(np.mean([len(b.get("loss_rows", b["tokens"].reshape(-1))) for b in timed]))
  out = {"config": c.method, "records": len(records), "steps": len(timed),
         "shapes": sorted(list(s) for s in widths), "mean_slots": slots,
         "mean_lm_head_rows": rows, "mean_answer_positions": float(np.mean(answers)),
         "gathered_median_s": float(np.median(g)), "full_median_s": float(np.median(f)),
         "gathered_positions_per_s": float(np.sum(answers) / np.sum(g)),
         "full_positions_per_s": float(np.sum(answers) / np.sum(f)),
         "speedup_median_of_ratios": float(np.median(f / g)),
         "speedup_iqr": [float(np.percentile(f / g, 25)), float(np.percentile(f / g, 75))]}
  print(json.dumps(out, indent=1))
  if _OUT.value:
    with open(_OUT.value, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
