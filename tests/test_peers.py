"""The peers: HF transformers' assisted generation and prompt lookup on tiny
random llamas written with specjax's own HF export, the llama.cpp peer's clean
absence, and the side-by-side experiment end to end on one prompt.

No timing thresholds: only that every mode runs, records its settings, and that
HF's greedy speculative outputs equal HF's greedy AR output (transformers' own
exactness, a sanity check of how the peer drives it)."""

import dataclasses
import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from specjax.benchmarks import peers as peers_bench
from specjax.errors import ConfigValueError
from specjax.io import hf as hf_io
from specjax.models import transformer
from specjax.models.config import tiny_config
from specjax.peers import hf, llamacpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The SmolLM2 vocabulary, so the experiment can use its tokenizer and chat template.
CFG = tiny_config(vocab_size=49152, dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_dim=128, max_seq_len=512, eos_id=2, pad_id=2)
PROMPT = [1, 5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]
NEW = 20


def _random_llama(path, scale: float, num_layers=None) -> str:
  """A random llama written as an HF directory; `scale` multiplies every matrix
  (x4: varied greedy continuations; x1: the init's near-constant ones)."""
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(0), CFG))
  params = jax.tree.map(lambda x: x * np.float32(scale) if x.ndim == 2 else x, params)
  cfg = CFG
  if num_layers is not None:  # the first layers: a cheap, related draft model
    params = dict(params, layers=params["layers"][:num_layers])
    cfg = CFG.replace(num_layers=num_layers)
  hf_io.save_hf(str(path), params, cfg)
  return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("peers")
  return {"target": _random_llama(root / "target", 4.0),
          "draft": _random_llama(root / "draft", 4.0, num_layers=1),
          "repetitive": _random_llama(root / "repetitive", 1.0)}


@pytest.fixture(scope="module")
def models(tiny):
  return {name: hf.load_hf_model(path) for name, path in tiny.items()}


def test_assisted_generation_equals_ar_and_records_settings(models):
  target, draft = models["target"], models["draft"]
  ar = hf.hf_greedy_generate(target, PROMPT, NEW)
  assert len(ar.tokens) == NEW and len(set(ar.tokens)) > 5  # a varied continuation
  assert (ar.first_tokens, ar.rounds, ar.decode_tokens) == (1, NEW - 1, NEW - 1)
  assisted = hf.hf_assisted_generate(target, draft, PROMPT, NEW, k=3)
  assert assisted.tokens == ar.tokens
  assert assisted.decode_tokens == NEW - assisted.first_tokens and assisted.decode_s > 0
  # A draft identical to the target: every round accepts all k = 3 guesses plus the
  # bonus token -- k reaches the assistant and the schedule stays constant.
  self_assisted = hf.hf_assisted_generate(target, models["target"], PROMPT, NEW, k=3)
  assert self_assisted.tokens == ar.tokens
  assert self_assisted.first_tokens == 4 and self_assisted.rounds == (NEW - 4 + 3) // 4
  s = hf.settings(target, mode="assisted", assistant=draft, k=3)
  assert s["num_assistant_tokens"] == 3 and s["num_assistant_tokens_schedule"] == "constant"
  assert s["assistant_confidence_threshold"] == 0.0 and s["assistant_layers"] == 1
  assert s["inference_mode"] and s["threads"] >= 1 and s["dtype"] == "torch.float32"
  assert {"torch", "transformers"} <= set(s)
  with pytest.raises(ValueError, match="num_assistant_tokens"):
    hf.hf_assisted_generate(target, draft, PROMPT, NEW, k=0)


def test_prompt_lookup_equals_ar_and_records_settings(models):
  for name in ("target", "repetitive"):
    model = models[name]
    ar = hf.hf_greedy_generate(model, PROMPT, NEW)
    lookup = hf.hf_prompt_lookup_generate(model, PROMPT, NEW, k=4, max_ngram=2)
    assert lookup.tokens == ar.tokens, name
  # The repetitive model repeats a prompt token: the lookups hit, so rounds carry
  # several tokens each.
  assert lookup.rounds < lookup.decode_tokens
  s = hf.settings(model, mode="prompt_lookup", k=4, max_ngram=2)
  assert (s["prompt_lookup_num_tokens"], s["max_matching_ngram_size"], s["min_ngram"]) == (4, 2, 1)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None,
                    reason="llama-cpp-python is installed")
def test_llamacpp_absent_names_the_extra(tiny):
  assert not llamacpp.available()
  with pytest.raises(ImportError, match=r"llamacpp"):
    llamacpp.load(tiny["target"])


def _config_module():
  spec = importlib.util.spec_from_file_location("configs_peers",
                                                os.path.join(ROOT, "configs", "peers.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_peers_take_their_settings_dataclass():
  """The config's defaults are the dataclass's, its variants apply; a
  ConfigDict is refused (the experiment main reads it into PeersSettings once)."""
  module = _config_module()
  assert peers_bench.PeersSettings.of(module.get_config()) == peers_bench.PeersSettings()
  quick = peers_bench.PeersSettings.of(module.get_config("quick+f32"))
  assert (quick.prompt_limit, quick.max_new_tokens, quick.repeats, quick.dtype) == (
      1, 32, 1, "float32")
  assert peers_bench.like_for_like_methods(quick) == {
      "draft model": "draft_model@k=4@draft_vocab=full",
      "prompt lookup": "prompt_lookup@k=4@max_ngram=3@min_ngram=1"}
  with pytest.raises(TypeError, match="PeersSettings"):
    peers_bench.run_peers(module.get_config(), progress=lambda line: None)
  # a count out of range is refused by name before any work (these ran, or said "no questions")
  for field, value in (("lookup_k", 0), ("threads", -1), ("llamacpp_ctx", 0), ("repeats", 0),
                       ("prompt_limit", -1), ("max_new_tokens", 2.5)):
    with pytest.raises(ConfigValueError, match=f"{field} must be a whole number >= "):
      peers_bench.run_peers(dataclasses.replace(quick, **{field: value}, out="/nonexistent/x"),
                            progress=lambda line: None)


def _peers_config(tmp_path, tiny, **overrides):
  c = _config_module().get_config("quick+f32")
  prompts = tmp_path / "q.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "category": cat, "turns": [t]}) + "\n"
                             for i, cat, t in [(7, "summarization", "Repeat: the cat sat."),
                                               (8, "summarization", "Not used."),
                                               (9, "qa", "Name a colour.")]))
  settings = dict(model=tiny["target"], tokenizer_from="smollm2-135m", prompts=str(prompts),
                  prompt_limit=1, max_new_tokens=6, repeats=2, k=2, lookup_k=3, max_ngram=2,
                  draft_model=tiny["draft"], out=str(tmp_path / "out"),
                  # the like-for-like prompt lookup: marked best, not run twice
                  best="prompt_lookup@k=3@max_ngram=2@min_ngram=1")
  c.update({**settings, **overrides})
  return peers_bench.PeersSettings.of(c)  # what experiments/peers.py does


@pytest.mark.slow  # the whole experiment through transformers
def test_experiment_end_to_end(tmp_path, tiny):
  c = _peers_config(tmp_path, tiny)
  out = peers_bench.run_peers(c, progress=lambda line: None)
  rows = {(r["impl"], r["mode"]): r for r in out["results"]}
  assert set(rows) == {("specjax", "AR"), ("specjax", "draft model"),
                       ("specjax", "prompt lookup (best)"), ("HF transformers", "AR"),
                       ("HF transformers", "assisted"), ("HF transformers", "prompt lookup")}
  for r in rows.values():
    assert r["num_prompts"] == 2 and r["tokens_per_s"] > 0 and r["greedy_identical"] is True, r
  assert rows[("HF transformers", "AR")]["speedup_vs_hf_ar"] == pytest.approx(1.0)
  assert rows[("specjax", "AR")]["speedup_vs_own_ar"] == pytest.approx(1.0)
  assert rows[("specjax", "draft model")]["k"] == 2 and rows[("HF transformers", "assisted")]["k"] == 2
  assert rows[("specjax", "prompt lookup (best)")]["ngram"] == rows[("HF transformers", "prompt lookup")]["ngram"] == 2
  assisted = out["settings"]["HF transformers|assisted"]
  assert assisted["assistant_dir"] == tiny["draft"] and assisted["num_assistant_tokens"] == 2
  assert out["settings"]["specjax"]["methods"]["draft model"].startswith(
      "draft_model@k=2@draft_vocab=full")
  assert {b["peer"] for b in out["best_against_best"]} == {"HF transformers"}
  md = open(os.path.join(c.out, "results.md")).read()
  assert md == out["markdown"] and "| specjax | prompt lookup (best) | 3 | 2 |" in md
  assert "Best against best" in md
  if not llamacpp.available():
    assert "llama.cpp" in out["skipped"] and "| llama.cpp | skipped:" in md
  saved = json.load(open(os.path.join(c.out, "results.json")))
  assert saved["results"] == out["results"]
  log = open(os.path.join(c.out, "log.jsonl")).read().splitlines()
  assert len(log) == 2 * len(rows)
  # Resumed with the same settings: nothing runs again, the same table comes out.
  again = peers_bench.run_peers(c, progress=lambda line: None)
  assert again["results"] == out["results"]
  assert open(os.path.join(c.out, "log.jsonl")).read().splitlines() == log
  with pytest.raises(ValueError, match="other settings"):
    peers_bench.run_peers(_peers_config(tmp_path, tiny, k=3), progress=lambda line: None)
