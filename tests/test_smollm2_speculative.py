"""Speculative decoding on the real SmolLM2-135M under sampling: the
long-horizon PIT test. Greedy identity with AR for the shipped drafters, prompt
lookup and the trees on a prompt of every Spec-Bench category runs with the
golden tokens (test_golden.py), on the same programs. Every drafter's
exactness on its own is tested on tiny models (test_speculative, test_medusa,
test_eagle, test_tree, the Monte-Carlo family)."""

import pytest

import golden
from specjax import sampling as sampling_lib
from specjax.analysis import montecarlo as mc
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.layer_skip import LayerSkip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def category_prompts(smollm2):
  """The shortest prompt of each Spec-Bench category (the golden runs' batch)."""
  return golden.smollm2_prompts(smollm2.tokenizer)


# 768 PIT values per test: 32 independent runs x 24 tokens (>= 3 (k + 1) = 12: rounds
# past all-accepts, bonus tokens and rollbacks), each row re-reading the prompt
ROWS, LENGTH = 32, 24


def test_long_horizon_pit_on_smollm2(smollm2, category_prompts):
  """Sampled speculative output (T = 0.8, top-k 50; layer-skip drafter at T = 1)
  passes the randomized PIT test against teacher-forced target distributions."""
  sampling = sampling_lib.SamplingConfig(temperature=0.8, top_k=50)
  drafter = LayerSkip(k=3, layers=tuple(range(0, 30, 2)),
                      sampling=sampling_lib.SamplingConfig(temperature=1.0))
  prompt = category_prompts[0]
  spec = sp.SpecConfig(sampling=sampling)
  cfg = smollm2.cfg.replace(eos_id=-1)  # every row runs the full horizon
  samples, stats = mc.sample_tokens(smollm2.params, cfg, drafter, [prompt], ROWS, LENGTH,
                                    spec=spec, chunk=ROWS)
  assert stats["accepted"] > 0 and stats["accepted"] < stats["proposed"]
  values = mc.pit_values(smollm2.params, cfg, prompt, samples[0], sampling, chunk=ROWS)
  result = mc.pit_test(values)
  assert result.pooled_pvalue > 1e-3, result


@pytest.mark.parametrize("method", ["medusa", "draft_model", "eagle3_tree"])
def test_long_horizon_pit_shipped_heads(smollm2, category_prompts, method):
  """Shipped drafters sampling at T = 1 for a T = 0.8 target: PIT-uniform
  (draft_model: the shipped distilled one; eagle3_tree: a sampled EAGLE-2 tree,
  siblings without replacement, 8 nodes: every verify holds 9 tokens a row)."""
  sampling = sampling_lib.SamplingConfig(temperature=0.8)
  drafter, heads = registry.make_drafter(method, {"k": 3, "temperature": 1.0, "tree_nodes": 8},
                                         smollm2)
  cfg = smollm2.cfg.replace(eos_id=-1)
  prompt = category_prompts[0]  # the shapes of the PIT test above: compiled once
  samples, stats = mc.sample_tokens(smollm2.params, cfg, drafter, [prompt], ROWS, LENGTH,
                                    draft_params=heads, spec=sp.SpecConfig(sampling=sampling),
                                    chunk=ROWS)
  assert stats["accepted"] > 0 and stats["accepted"] < stats["proposed"]
  result = mc.pit_test(mc.pit_values(smollm2.params, cfg, prompt, samples[0], sampling,
                                     chunk=ROWS))
  assert result.pooled_pvalue > 1e-3, result
