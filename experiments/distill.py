"""Generate (or resume) self-distillation answers for drafter training.

  python experiments/distill.py --config=configs/distill.py --config.out=/path/distill.jsonl
"""

from absl import app
from absl import logging
from ml_collections import config_flags

from specjax.io.load import load_model
from specjax.training import distill_data

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill.py", "Run configuration.")


def main(argv):
  del argv
  c = _CONFIG.value
  if not c.out:
    raise app.UsageError("--config.out=<file.jsonl> is required (the data is appended there)")
  settings = dict(num_examples=c.num_examples, seed=c.seed, max_new_tokens=c.max_new_tokens,
                  max_prompt_tokens=c.max_prompt_tokens, batch_size=c.batch_size,
                  sample_fraction=c.sample_fraction, temperature=c.temperature, top_p=c.top_p,
                  valid_fraction=c.valid_fraction, chunk_steps=c.chunk_steps,
                  block_examples=c.block_examples)
  distill_data.check_generation(**settings)  # before the model loads
  # the default forward: large refilled batches (its GEMM is the faster there)
  model = load_model(c.model, dtype=c.dtype, batch_invariant=False)
  step = {"n": 0}

  def progress(line):
    step["n"] += 1
    if step["n"] % 25 == 1:
      logging.info(line)
      print(line, flush=True)

  records = distill_data.generate_dataset(
      model, c.out, sources=[s.strip() for s in c.sources.split(",") if s.strip()],
      model_name=c.model, progress=progress, **settings)
  answered = sum(len(r["answer"]) for r in records)
  print(f"{c.out}: {len(records)} records, {answered} answer tokens")


if __name__ == "__main__":
  app.run(main)
