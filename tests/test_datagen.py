"""The answer-generation throughput benchmark (configs/datagen.py) end to end
on the session's tiny GGUF (SmolLM2's tokenizer and vocabulary, 2 layers)."""

import dataclasses
import importlib.util

import pytest

from specjax.benchmarks import datagen
from specjax.errors import ConfigValueError


@pytest.mark.slow  # generates with every way measured
def test_ways_side_by_side(tiny_gguf, load_config):
  c = load_config("datagen.py", "quick")
  with c.unlocked():
    c.model, c.dtypes, c.num_prompts, c.max_new_tokens, c.batch_size = (
        str(tiny_gguf.path), "float32", 6, 6, 4)
    c.sources, c.max_prompt_tokens, c.ways = "alpaca,gsm8k_train", 256, "static,continuous,hf"
  settings = datagen.DatagenSettings.of(c)  # what experiments/datagen.py does
  out = datagen.run(settings, progress=lambda line: None)
  rows = {r["way"]: r for r in out["rows"]}
  assert set(rows) == {"static", "continuous", "hf"}
  # the same prompts and greedy answers, whichever way they were generated: the
  # two specjax ways token for token, and HF transformers on the same GGUF file
  # (a left-padded batch; the tiny random model's answers have no near-ties at
  # 6 tokens)
  assert rows["static"]["new_tokens"] == rows["continuous"]["new_tokens"] > 6
  assert rows["continuous"]["same_answers"] == rows["static"]["same_answers"] == 6
  assert rows["hf"]["same_answers"] >= 5 and rows["hf"]["dtype"] == "float32"
  assert all(r["tokens_per_s"] > 0 and r["prompts"] == 6 for r in rows.values())
  assert rows["static"]["vs_fastest_static"] == 1.0
  assert "| continuous | float32 | 4 | 6 |" in out["markdown"]
  assert "| hf | float32 | 4 | 6 |" in out["markdown"]
  with pytest.raises(ValueError, match="unknown way 'magic'"):
    datagen.run(dataclasses.replace(settings, ways="static,magic"), progress=lambda line: None)
  with pytest.raises(ValueError, match="at least one specjax way"):
    datagen.run(dataclasses.replace(settings, ways="hf"), progress=lambda line: None)


def test_hf_batch_generate_refuses_bad_input():
  from specjax.peers import hf  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    hf.hf_batch_generate(None, [[1, 2]], 0)
  with pytest.raises(ValueError, match="no empty prompt"):
    hf.hf_batch_generate(None, [[1, 2], []], 4)


def test_datagen_takes_its_settings_dataclass(load_config):
  """The config's defaults are the dataclass's; a ConfigDict is refused (the
  experiment main reads it into DatagenSettings once)."""
  assert datagen.DatagenSettings.of(load_config("datagen.py")) == datagen.DatagenSettings()
  quick = datagen.DatagenSettings.of(load_config("datagen.py", "quick"))
  assert (quick.num_prompts, quick.max_new_tokens, quick.batch_size, quick.repeats) == (
      16, 64, 8, 1)
  with pytest.raises(TypeError, match="DatagenSettings"):
    datagen.run(load_config("datagen.py", "quick"), progress=lambda line: None)
  for field, value in (("num_prompts", 0), ("repeats", 0), ("batch_size", -1), ("seed", -1)):
    with pytest.raises(ConfigValueError, match=f"{field} must be a whole number"):
      datagen.run(dataclasses.replace(quick, **{field: value}), progress=lambda line: None)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp peer not installed (optional extra: pip install -e '.[llamacpp]')")
def test_llamacpp_way(tiny_gguf, load_config):
  """llama.cpp answers the same prompts from the same GGUF file, one at a time
  in a process of its own, and is closed after the run."""
  c = load_config("datagen.py", "quick")
  with c.unlocked():
    c.model, c.dtypes, c.num_prompts, c.max_new_tokens, c.batch_size = (
        str(tiny_gguf.path), "float32", 3, 6, 4)
    c.sources, c.max_prompt_tokens, c.ways = "alpaca", 256, "static,llamacpp"
  out = datagen.run(datagen.DatagenSettings.of(c), progress=lambda line: None)
  rows = {r["way"]: r for r in out["rows"]}
  assert rows["llamacpp"]["dtype"] == "gguf" and rows["llamacpp"]["batch_size"] == 1
  assert rows["llamacpp"]["prompts"] == 3 and rows["llamacpp"]["new_tokens"] >= 3
  assert 0 <= rows["llamacpp"]["same_answers"] <= 3 and rows["llamacpp"]["tokens_per_s"] > 0
