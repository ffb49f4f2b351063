"""Speculative decoding on the real SmolLM2-135M: greedy identity with AR for
the shipped (trained) drafters, prompt lookup and the tree verifier on a prompt
of every Spec-Bench category (one ragged batch), and the long-horizon PIT test
under sampling. Every drafter's exactness on its own is tested on tiny models
(test_speculative, test_medusa, test_eagle, test_tree, the Monte-Carlo family)."""

import json
import os

import pytest

from specjax import sampling as sampling_lib
from specjax.analysis import greedy_identity
from specjax.analysis import montecarlo as mc
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.layer_skip import LayerSkip
from specjax.drafters.prompt_lookup import PromptLookup

SPEC_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench",
                          "question_excl_mtbench.jsonl")
NEW = 32


MAX_CHARS = 700  # long RAG / summarization records are cut (head + tail) to one bucket


@pytest.fixture(scope="module")
def category_prompts(smollm2):
  """The shortest prompt of each Spec-Bench category, through the chat template."""
  best = {}
  with open(SPEC_BENCH) as f:
    for line in f:
      rec = json.loads(line)
      text = rec["turns"][0]
      if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS // 2] + " ... " + text[-MAX_CHARS // 2:]
      ids = smollm2.tokenizer.encode_prompt(text)
      if rec["category"] not in best or len(ids) < len(best[rec["category"]]):
        best[rec["category"]] = ids
  assert len(best) == 5
  assert max(len(p) for p in best.values()) <= 256
  return [best[c] for c in sorted(best)]


@pytest.fixture(scope="module")
def ar_reference(smollm2, category_prompts):
  return ar.generate(smollm2.params, smollm2.cfg, category_prompts, max_new_tokens=NEW).tokens


@pytest.fixture(scope="module")
def delta(smollm2, category_prompts, ar_reference):
  """Near-tie threshold: 10x the measured block-vs-step logit difference (f32)."""
  diff = greedy_identity.block_vs_step_difference(smollm2.params, smollm2.cfg,
                                                  category_prompts[0], ar_reference[0][:5])
  assert diff < 5e-3, diff
  return 10 * max(diff, 1e-5)


def _drafters(model):
  """The drafters with trained or model-derived parts, on the real model (every
  drafter's greedy identity, including blockwise, layer skipping, replay and
  always-reject, is tested on tiny models in test_speculative / test_medusa /
  test_eagle / test_tree; here: the shipped weights and the tree verifier)."""
  return [
      registry.make_drafter("medusa", {"k": 3}, model),  # the shipped heads
      registry.make_drafter("medusa_tree", {"k": 3, "tree_nodes": 16}, model),  # tree verify
      registry.make_drafter("eagle", {"k": 3}, model),  # shipped, reduced vocabulary
      registry.make_drafter("eagle3", {"k": 3, "draft_vocab": "full"}, model),
      registry.make_drafter("eagle3_tree", {"k": 3, "tree_nodes": 16}, model),
      (PromptLookup(k=4), None),
      registry.make_drafter("draft_model", {"k": 3}, model),  # shipped: distilled, 8192 vocab
  ]


def test_greedy_identity_shipped_drafters_every_category(smollm2, category_prompts, ar_reference,
                                                      delta):
  near_ties = 0
  for drafter, dparams in _drafters(smollm2):
    res = sp.generate(smollm2.params, smollm2.cfg, drafter, category_prompts,
                      draft_params=dparams, max_new_tokens=NEW)
    for prompt, ref, got in zip(category_prompts, ar_reference, res.tokens):
      cmp = greedy_identity.compare(smollm2.params, smollm2.cfg, prompt, ref, got, delta)
      assert cmp.status != "diverged", (drafter.name, cmp, delta)
      near_ties += cmp.status == "near_tie"
  assert near_ties <= 2, near_ties  # reported; more would suggest a real bug


def test_long_horizon_pit_on_smollm2(smollm2, category_prompts):
  """Sampled speculative output (T = 0.8, top-k 50; layer-skip drafter at T = 1)
  passes the randomized PIT test against teacher-forced target distributions."""
  sampling = sampling_lib.SamplingConfig(temperature=0.8, top_k=50)
  drafter = LayerSkip(k=3, layers=tuple(range(0, 30, 2)),
                      sampling=sampling_lib.SamplingConfig(temperature=1.0))
  prompt = category_prompts[0]
  length = 16  # >= 3 (k + 1)
  spec = sp.SpecConfig(sampling=sampling)
  cfg = smollm2.cfg.replace(eos_id=-1)  # every row runs the full horizon
  samples, stats = mc.sample_tokens(smollm2.params, cfg, drafter, [prompt], 48, length,
                                    spec=spec, chunk=48)
  assert stats["accepted"] > 0 and stats["accepted"] < stats["proposed"]
  values = mc.pit_values(smollm2.params, cfg, prompt, samples[0], sampling, chunk=48)
  result = mc.pit_test(values)
  assert result.pooled_pvalue > 1e-3, result


@pytest.mark.parametrize("method", ["medusa", "draft_model", "eagle3_tree"])
def test_long_horizon_pit_shipped_heads(smollm2, category_prompts, method):
  """Shipped drafters sampling at T = 1 for a T = 0.8 target: PIT-uniform
  (draft_model: the shipped distilled one; eagle3_tree: a sampled EAGLE-2 tree,
  siblings without replacement)."""
  sampling = sampling_lib.SamplingConfig(temperature=0.8)
  drafter, heads = registry.make_drafter(method, {"k": 3, "temperature": 1.0}, smollm2)
  cfg = smollm2.cfg.replace(eos_id=-1)
  prompt = category_prompts[0]  # the shapes of the PIT test above: compiled once
  samples, stats = mc.sample_tokens(smollm2.params, cfg, drafter, [prompt], 48, 16,
                                    draft_params=heads, spec=sp.SpecConfig(sampling=sampling),
                                    chunk=48)
  assert stats["accepted"] > 0 and stats["accepted"] < stats["proposed"]
  result = mc.pit_test(mc.pit_values(smollm2.params, cfg, prompt, samples[0], sampling,
                                     chunk=48))
  assert result.pooled_pvalue > 1e-3, result
