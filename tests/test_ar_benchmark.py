"""Smoke tests of the AR benchmark's pieces: the figures are sane (finite,
positive, consistent) -- never "fast enough": no timing thresholds anywhere."""

import dataclasses
import importlib.util
import json
import math
import os
import sys

import jax
import pytest

from specjax.analysis import roofline
from specjax.benchmarks import ar
from specjax.benchmarks import report
from specjax.errors import ConfigValueError
from specjax.io.load import Model
from specjax.models import transformer
from specjax.models.config import tiny_config
from specjax.peers import hf

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "..", "configs", "ar_benchmark.py")


def get_config(arg=None):
  spec = importlib.util.spec_from_file_location("ar_benchmark_config", CONFIG_FILE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def small_config(**overrides):
  c = get_config("quick+nopeers")
  with c.unlocked():
    c.max_new_tokens, c.batch_sizes, c.repeats, c.bandwidth_gib = 6, (1, 3), 2, 1 / 128
    c.update(overrides)
  return ar.ARBenchmarkSettings.of(c)  # what experiments/ar_benchmark.py does


def positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_spread(s):
  assert s["q1"] <= s["median"] <= s["q3"] and positive(s["median"]), s


# --- roofline ---------------------------------------------------------------------------


def test_weight_bytes_counts_every_leaf():
  cfg = tiny_config()
  params = transformer.init(jax.random.key(0), cfg)
  assert roofline.weight_bytes(params) == 4 * cfg.num_params()
  half = jax.tree.map(lambda x: x.astype("bfloat16"), params)
  assert roofline.weight_bytes(half) == 2 * cfg.num_params()
  # Shapes are enough: works on jax.eval_shape output too.
  assert roofline.weight_bytes(jax.eval_shape(lambda: params)) == 4 * cfg.num_params()


def test_roofline_arithmetic():
  # SmolLM2's 538 MB of float32 weights at 23.5 GB/s: ~22.9 ms per step.
  assert roofline.roofline_ms_per_token(538e6, 23.5) == pytest.approx(22.894, abs=1e-3)
  assert roofline.roofline_ms_per_token(1e9, 1.0) == pytest.approx(1000.0)
  with pytest.raises(ValueError):
    roofline.roofline_ms_per_token(1e9, 0.0)


def test_measure_read_bandwidth_small():
  bw = roofline.measure_read_bandwidth(8 << 20, repeats=3)
  assert bw["bytes"] == 8 << 20 and bw["repeats"] == 3 and len(bw["times_s"]) == 3
  assert positive(bw["best_gbps"]) and positive(bw["median_gbps"])
  assert bw["best_gbps"] >= bw["median_gbps"]
  with pytest.raises(ValueError):
    roofline.measure_read_bandwidth(8 << 20, repeats=0)


# --- helpers ----------------------------------------------------------------------------


def test_spread_and_eos_helpers():
  assert ar.spread([3.0]) == {"median": 3.0, "q1": 3.0, "q3": 3.0, "n": 1}
  s = ar.spread([1.0, 2.0, 3.0, 4.0, 5.0])
  assert (s["q1"], s["median"], s["q3"]) == (2.0, 3.0, 4.0)
  assert report.upto_eos([5, 2, 7], 2) == [5, 2]
  assert report.upto_eos([5, 6], 2) == [5, 6]
  # HF may continue with pads after EOS: compared only up to EOS.
  assert ar.compare_greedy([4, 5, 2], [4, 5, 2, 2, 2], 2)["identical_up_to_eos"]
  diff = ar.compare_greedy([4, 5, 6], [4, 9, 6], 2)
  assert not diff["identical_up_to_eos"] and diff["first_mismatch"] == 1
  assert ar.compare_greedy([4, 5], [4, 5, 6], 2)["first_mismatch"] == 2


def test_config_variants():
  c = get_config()
  assert c.max_new_tokens == 128 and tuple(c.batch_sizes) == (1, 4, 16) and c.repeats == 5
  assert c.peers == hf.available() and c.bandwidth_gib == 1.0 and c.out is None
  q = get_config("quick+nopeers+bf16")
  assert (q.max_new_tokens, q.peers, q.dtype) == (16, False, "bfloat16")
  with pytest.raises(ValueError, match="unknown variant"):
    get_config("fast")


def test_ar_benchmark_takes_its_settings_dataclass():
  """The config's defaults are the dataclass's; a ConfigDict is refused (the
  experiment main reads it into ARBenchmarkSettings once)."""
  assert ar.ARBenchmarkSettings.of(get_config()) == ar.ARBenchmarkSettings()
  q = ar.ARBenchmarkSettings.of(get_config("quick+nopeers+bf16"))
  assert (q.max_new_tokens, q.batch_sizes, q.peers, q.dtype) == (16, (1,), False, "bfloat16")
  with pytest.raises(TypeError, match="ARBenchmarkSettings"):
    ar.run_ar_benchmark(get_config("quick+nopeers"), prompt_ids=[1, 5, 9])
  # out of range: refused by name before the bandwidth probe and any model
  for fields, match in ((dict(bandwidth_gib=-1.0), r"bandwidth_gib must be .* \(0, inf\)"),
                        (dict(batch_sizes=(1, 0)), "batch_sizes must be a whole number >= 1"),
                        (dict(batch_sizes=()), "no batch sizes"),
                        (dict(repeats=0), "repeats must be a whole number >= 1")):
    with pytest.raises(ConfigValueError, match=match):
      ar.run_ar_benchmark(dataclasses.replace(q, **fields), prompt_ids=[1, 5, 9])


# --- the benchmark on a tiny random model -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
  cfg = tiny_config(eos_id=63)  # an id this model does not emit for the prompt below
  params = transformer.init(jax.random.key(3), cfg)
  return Model(params=params, cfg=cfg, tokenizer=None, source="<tiny>")


def test_run_ar_benchmark_tiny(tiny_model, tmp_path):
  lines = []
  out = ar.run_ar_benchmark(small_config(), model=tiny_model, prompt_ids=[1, 5, 9, 13],
                            log=lines.append)
  assert lines and out["hf"] is None and out["speedup_vs_hf"] is None
  assert out["weight_bytes"] == 4 * tiny_model.cfg.num_params()
  assert positive(out["roofline_ms_per_step"]) and positive(out["peak_rss_mb"])
  assert positive(out["bandwidth"]["best_gbps"])
  assert [r["batch_size"] for r in out["specjax"]] == [1, 3]
  for r in out["specjax"]:
    b = r["batch_size"]
    assert r["new_tokens_per_row"] == [6] * b and r["decode_steps"] == 5
    for key in ("ms_per_step", "tokens_per_s_per_row", "tokens_per_s_aggregate", "prefill_s"):
      check_spread(r[key])
      assert r[key]["n"] == 2
    assert r["tokens_per_s_aggregate"]["median"] == pytest.approx(
        b * r["tokens_per_s_per_row"]["median"])
    assert positive(r["compile_run_s"]) and positive(r["roofline_ratio"])
    assert r["roofline_with_kv_ms_per_step"] > r["roofline_ms_per_step"]
    assert r["num_slots"] >= 4 + 6 and r["kv_cache_bytes"] == ar.kv_cache_bytes(
        tiny_model, b, r["num_slots"])
    assert r["rows_match_b1"] is True
  table = ar.format_table(out)
  assert table.count("| specjax |") == 2 and "HF transformers" not in table
  json.dumps(out)  # what the experiment writes


def test_peers_require_gguf_source(tiny_model):
  if not hf.available():
    pytest.skip("needs the peers extra")
  with pytest.raises(ValueError, match="GGUF"):
    ar.run_ar_benchmark(small_config(peers=True), model=tiny_model, prompt_ids=[1, 5, 9])


def test_missing_extra_names_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
  with pytest.raises(ImportError, match="peers"):
    hf.load_hf_gguf("model.gguf")


# --- the real model against HF transformers ----------------------------------------------


@pytest.mark.slow
def test_run_ar_benchmark_smollm2_with_hf(smollm2, hf_smollm2):
  out = ar.run_ar_benchmark(small_config(max_new_tokens=4, batch_sizes=(1,), repeats=1,
                                         peers=True),
                            model=smollm2, hf_model=hf_smollm2.model)
  h = out["hf"]
  check_spread(h["tokens_per_s"])
  check_spread(h["prefill_s"])
  assert h["new_tokens"] == 4 and positive(h["roofline_ratio"])
  assert h["settings"]["inference_mode"] and h["settings"]["threads"] >= 1
  assert h["settings"]["dtype"] == "torch.float32"
  assert positive(out["speedup_vs_hf"]["median_of_ratios"])
  assert out["greedy_match"]["identical_up_to_eos"], out["greedy_match"]
  assert out["weight_bytes"] == pytest.approx(538e6, rel=0.01)
  assert "| HF transformers | 1 |" in ar.format_table(out)
