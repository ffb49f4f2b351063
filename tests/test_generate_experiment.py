"""Smoke tests of the generate experiment: configs/smollm2.py through the runner
in-process (reusing the session's model), and experiments/generate.py as a
subprocess, the way the README runs it."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from specjax import runner
from specjax.drafters.settings import DrafterSettings
from specjax.errors import ConfigValueError

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_config_file(name):
  """configs/<name>.py by path, as --config=configs/<name>.py loads it."""
  spec = importlib.util.spec_from_file_location(f"configs_{name}",
                                                os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


smollm2_config = _load_config_file("smollm2")

METRICS = {"method", "prompt_tokens", "new_tokens", "batch_size", "timed_runs", "tokens_per_s",
           "ms_per_token",
           "time_to_first_token_s", "compile_and_first_run_s", "dtype", "temperature", "top_k",
           "top_p", "peak_rss_mb"}


def small_config(variant=None, max_new_tokens=8, repeats=0):
  c = smollm2_config.get_config(variant)
  c.max_new_tokens = max_new_tokens  # the config is locked: existing fields only
  c.repeats = repeats
  return c


@pytest.mark.parametrize("variant, temperature, top_p, repeats",
                         [(None, 0.0, 1.0, 0), ("sample", 0.7, 0.9, 1)])
def test_generate_from_config(smollm2, variant, temperature, top_p, repeats):
  out = runner.generate_from_config(small_config(variant, repeats=repeats), model=smollm2)
  assert METRICS | {"answer"} <= set(out)
  assert isinstance(out["answer"], str) and out["answer"].strip()
  assert out["method"] == "ar" and out["dtype"] == "float32" and out["batch_size"] == 1
  assert (out["temperature"], out["top_p"]) == (temperature, top_p)
  assert 0 < out["new_tokens"] <= 8
  assert out["prompt_tokens"] > 10
  assert out["timed_runs"] == repeats and out["compile_and_first_run_s"] > 0
  if repeats:
    assert out["tokens_per_s"] > 0 and out["ms_per_token"] > 0
  else:  # the compile run alone: no speed is reported as if measured
    assert out["tokens_per_s"] is None and out["ms_per_token"] is None
  json.dumps(out)  # what the main prints must be JSON


def test_generate_takes_its_settings_dataclass(smollm2):
  """The entry point takes a GenerateSettings only; the experiment main turns
  the config into one at the boundary, so both give the same answer
  (speculative, so the drafter's settings travel too)."""
  c = small_config()
  c.method, c.k = "prompt_lookup", 3
  settings = runner.GenerateSettings(
      max_new_tokens=8, repeats=0, method="prompt_lookup",
      drafter=DrafterSettings(k=3))
  assert runner.GenerateSettings.of(c) == settings
  out = runner.generate(settings, model=smollm2)
  assert out["method"] == "prompt_lookup" and 0 < out["new_tokens"] <= 8
  assert out["answer"] == runner.generate_from_config(c, model=smollm2)["answer"]
  # A method's own '@' fields override the drafter settings (k = 3 again: the
  # programs above are reused), and a field the method does not have is refused.
  at = runner.generate(dataclasses.replace(settings, method="prompt_lookup@k=3",
                                           drafter=DrafterSettings(k=5)), model=smollm2)
  assert at["k"] == 3 and at["answer"] == out["answer"]  # greedy: the answer alone cannot tell
  with pytest.raises(ConfigValueError, match="unknown field 'bogus'"):
    runner.generate(dataclasses.replace(settings, method="prompt_lookup@bogus=1"), model=smollm2)
  with pytest.raises(TypeError, match="GenerateSettings"):
    runner.generate(c, model=smollm2)


def test_config_defaults_are_the_settings_defaults():
  """One default per field: configs/smollm2.py takes them from GenerateSettings."""
  assert runner.GenerateSettings.of(smollm2_config.get_config()) == runner.GenerateSettings()
  sample = runner.GenerateSettings.of(smollm2_config.get_config("sample"))
  assert (sample.sampling.temperature, sample.sampling.top_p) == (0.7, 0.9)


def test_a_plain_dict_config_refuses_an_unknown_key():
  """A ConfigDict's flags refuse a misspelled field; a plain dict is checked
  by the settings (it would otherwise run the default silently)."""
  s = runner.GenerateSettings.of({"temperature": 0.7, "max_new_tokens": 5, "method": "eagle",
                                  "k": 2})
  assert (s.sampling.temperature, s.max_new_tokens, s.method, s.drafter.k) == (0.7, 5, "eagle", 2)
  with pytest.raises(ConfigValueError, match="unknown setting.*'max_new_token', 'tempreature'"):
    runner.GenerateSettings.of({"tempreature": 0.7, "max_new_token": 5})


def test_config_variants():
  assert smollm2_config.get_config("bf16").dtype == "bfloat16"
  both = smollm2_config.get_config("sample+bf16")
  assert (both.dtype, both.temperature, both.top_p) == ("bfloat16", 0.7, 0.9)
  with pytest.raises(AttributeError):  # locked: a typo cannot add a field
    smollm2_config.get_config().max_new_token = 3


def test_unknown_variant_raises():
  with pytest.raises(ValueError, match="unknown variant 'turbo'"):
    smollm2_config.get_config("turbo")


def test_unknown_method_raises(smollm2):
  c = small_config()
  c.method = "magic"
  with pytest.raises(ValueError, match="unknown method 'magic'"):
    runner.generate_from_config(c, model=smollm2)


@pytest.mark.parametrize("field,value,low", [("repeats", -1, 0), ("batch_size", 0, 1),
                                             ("max_new_tokens", -2, 1), ("repeats", 1.5, 0),
                                             ("batch_size", True, 1)])
def test_counts_out_of_range_are_refused_before_the_model_loads(field, value, low):
  # no model given: the refusal comes before anything loads
  with pytest.raises(ConfigValueError,
                     match=f"{field} must be a whole number >= {low}, got {value!r}"):
    runner.generate(runner.GenerateSettings(model="no-such-model", **{field: value}))


def test_experiment_main_subprocess():
  proc = subprocess.run(
      [sys.executable, "experiments/generate.py", "--config=configs/smollm2.py",
       "--config.max_new_tokens=4", "--config.repeats=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The answer comes first, then the metrics as an indented JSON object.
  lines = proc.stdout.splitlines()
  start = max(i for i, line in enumerate(lines) if line == "{")
  metrics = json.loads("\n".join(lines[start:]))
  assert METRICS <= set(metrics)
  assert 0 < metrics["new_tokens"] <= 4
  assert "\n".join(lines[:start]).strip(), "no answer printed"
