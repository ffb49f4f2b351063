"""The answer-generation throughput benchmark (configs/datagen.py) end to end
on the session's tiny GGUF (SmolLM2's tokenizer and vocabulary, 2 layers)."""

import dataclasses

import pytest

from specjax.benchmarks import datagen


@pytest.mark.slow  # generates with every way measured
def test_ways_side_by_side(tiny_gguf, load_config):
  c = load_config("datagen.py", "quick")
  with c.unlocked():
    c.model, c.dtypes, c.num_prompts, c.max_new_tokens, c.batch_size = (
        str(tiny_gguf.path), "float32", 6, 6, 4)
    c.sources, c.max_prompt_tokens = "alpaca,gsm8k_train", 256
  settings = datagen.DatagenSettings.of(c)  # what experiments/datagen.py does
  out = datagen.run(settings, progress=lambda line: None)
  rows = {r["way"]: r for r in out["rows"]}
  assert set(rows) == {"static", "continuous"}
  # the same prompts and greedy answers, whichever way they were generated
  assert rows["static"]["new_tokens"] == rows["continuous"]["new_tokens"] > 6
  assert all(r["tokens_per_s"] > 0 and r["prompts"] == 6 for r in rows.values())
  assert rows["static"]["vs_fastest_static"] == 1.0
  assert "| continuous | float32 | 4 | 6 |" in out["markdown"]
  with pytest.raises(ValueError, match="unknown way 'magic'"):
    datagen.run(dataclasses.replace(settings, ways="static,magic"), progress=lambda line: None)


def test_datagen_takes_its_settings_dataclass(load_config):
  """The config's defaults are the dataclass's; a ConfigDict is refused (the
  experiment main reads it into DatagenSettings once)."""
  assert datagen.DatagenSettings.of(load_config("datagen.py")) == datagen.DatagenSettings()
  quick = datagen.DatagenSettings.of(load_config("datagen.py", "quick"))
  assert (quick.num_prompts, quick.max_new_tokens, quick.batch_size, quick.repeats) == (
      16, 64, 8, 1)
  with pytest.raises(TypeError, match="DatagenSettings"):
    datagen.run(load_config("datagen.py", "quick"), progress=lambda line: None)
