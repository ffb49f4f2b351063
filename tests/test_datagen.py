"""The answer-generation throughput benchmark (configs/datagen.py) end to end
on the session's tiny GGUF (SmolLM2's tokenizer and vocabulary, 2 layers)."""

import pytest

from specjax.benchmarks import datagen


@pytest.mark.slow  # generates with every way measured
def test_ways_side_by_side(tiny_gguf, load_config):
  c = load_config("datagen.py", "quick")
  with c.unlocked():
    c.model, c.dtypes, c.num_prompts, c.max_new_tokens, c.batch_size = (
        str(tiny_gguf.path), "float32", 6, 6, 4)
    c.sources, c.max_prompt_tokens = "alpaca,gsm8k_train", 256
  out = datagen.run(c, progress=lambda line: None)
  rows = {r["way"]: r for r in out["rows"]}
  assert set(rows) == {"static", "continuous"}
  # the same prompts and greedy answers, whichever way they were generated
  assert rows["static"]["new_tokens"] == rows["continuous"]["new_tokens"] > 6
  assert all(r["tokens_per_s"] > 0 and r["prompts"] == 6 for r in rows.values())
  assert rows["static"]["vs_fastest_static"] == 1.0
  assert "| continuous | float32 | 4 | 6 |" in out["markdown"]
  with c.unlocked():
    c.ways = "static,magic"
  with pytest.raises(ValueError, match="unknown way 'magic'"):
    datagen.run(c, progress=lambda line: None)
