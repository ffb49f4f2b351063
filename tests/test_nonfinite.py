"""NaN / inf logits inside decoding are detected and reported, never silently
emitted: AR, chain speculative and tree speculative decoding stop a row before
the first token whose logits are not finite and raise NonFiniteLogitsError
naming the row and the token; clean models never trigger it."""

import jax
import jax.numpy as jnp
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import lookahead as la
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.errors import NonFiniteLogitsError
from specjax.models import transformer
from specjax.models.config import tiny_config

# An untied LM head: a NaN in one embedding row then poisons only the steps
# that feed that token, not every logit of every step.
CFG = tiny_config(eos_id=-1, pad_id=0, tie_embeddings=False)
DCFG = tiny_config(num_layers=1, eos_id=-1, pad_id=0, tie_embeddings=False)
PROMPTS = [[5, 9, 13, 5, 9], [7, 11, 3, 20]]
NEW = 12
SAMPLED = sampling_lib.SamplingConfig(temperature=0.8)


@pytest.fixture(scope="module")
def target():
  p = transformer.init(jax.random.key(1), CFG)
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


@pytest.fixture(scope="module")
def draft():
  return transformer.init(jax.random.key(2), DCFG)


@pytest.fixture(scope="module")
def clean(target):
  return ar.generate(target, CFG, PROMPTS, max_new_tokens=NEW).tokens


def _poison(params, token):
  """params with a NaN in `token`'s embedding row."""
  embed = params["embed"].at[token, 3].set(jnp.nan)
  return {**params, "embed": embed}


def _poisoned_token(clean):
  """A token row 0 emits (not at its very end) that no prompt holds, and the
  index of the first output token whose logits then see it."""
  for j, tok in enumerate(clean[0][:NEW - 2]):
    if all(tok not in p for p in PROMPTS):
      return tok, j + 1
  pytest.skip("no suitable token in the clean output")


def _expected_first_bad(tokens, token):
  return tokens.index(token) + 1 if token in tokens else None


def test_clean_models_do_not_trigger(target, draft, clean):
  assert all(len(t) == NEW for t in clean)
  for sampling in (sampling_lib.GREEDY, SAMPLED):
    spec = sp.SpecConfig(sampling=sampling)
    ar.generate(target, CFG, PROMPTS, max_new_tokens=NEW, sampling=sampling)
    out = sp.generate(target, CFG, DraftModel(k=3, cfg=DCFG, sampling=sampling), PROMPTS,
                      draft_params=draft, spec=spec, max_new_tokens=NEW)
    if sampling.greedy:
      assert out.tokens == clean


def test_nan_everywhere_stops_at_the_first_token(target):
  bad = jax.tree.map(lambda x: x, target)
  bad["layers"][1] = {**bad["layers"][1], "w_down": bad["layers"][1]["w_down"].at[0, 0].set(
      jnp.nan)}
  with pytest.raises(NonFiniteLogitsError, match=r"row 0 at output token 0") as e:
    ar.generate(bad, CFG, PROMPTS, max_new_tokens=NEW)
  assert e.value.rows == [0, 1] and e.value.token_index == [0, 0]
  assert e.value.result.tokens == [[], []]  # nothing drawn from NaN was emitted
  with pytest.raises(NonFiniteLogitsError) as e:
    sp.generate(bad, CFG, PromptLookup(k=3), PROMPTS, max_new_tokens=NEW)
  assert e.value.rows == [0, 1] and e.value.token_index == [0, 0]
  assert e.value.result.tokens == [[], []]


@pytest.mark.parametrize("sampling", [sampling_lib.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_autoregressive_stops_before_the_first_nonfinite_token(target, sampling):
  clean = ar.generate(target, CFG, PROMPTS, max_new_tokens=NEW, sampling=sampling).tokens
  token, first_bad = _poisoned_token(clean)
  with pytest.raises(NonFiniteLogitsError) as e:
    ar.generate(_poison(target, token), CFG, PROMPTS, max_new_tokens=NEW, sampling=sampling)
  expected = {i: _expected_first_bad(t, token) for i, t in enumerate(clean)}
  expected = {i: j for i, j in expected.items() if j is not None and j < NEW}
  assert dict(zip(e.value.rows, e.value.token_index)) == expected
  assert expected[0] == first_bad
  for i, toks in enumerate(e.value.result.tokens):  # the tokens before it are the clean ones
    assert toks == clean[i][:expected.get(i, NEW)]


@pytest.mark.parametrize("make_drafter", [
    lambda s: PromptLookup(k=3, max_ngram=2),
    lambda s: DraftModel(k=3, cfg=DCFG, sampling=s),
    lambda s: la.LookaheadTree(k=2, window=4, ngram=3, max_candidates=4, pool_size=32),
], ids=["prompt_lookup", "draft_model", "lookahead_tree"])
@pytest.mark.parametrize("sampling", [sampling_lib.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculative_stops_before_the_first_nonfinite_token(target, draft, make_drafter,
                                                            sampling):
  drafter = make_drafter(sampling)
  spec = sp.SpecConfig(sampling=sampling)
  run = lambda params: sp.generate(params, CFG, drafter, PROMPTS, draft_params=draft if isinstance(
      drafter, DraftModel) else None, spec=spec, max_new_tokens=NEW)
  clean = run(target).tokens
  token, _ = _poisoned_token(clean)
  with pytest.raises(NonFiniteLogitsError, match="speculative decoding") as e:
    run(_poison(target, token))
  bad = dict(zip(e.value.rows, e.value.token_index))
  assert 0 in bad
  for i, toks in enumerate(clean):
    j = _expected_first_bad(toks, token)
    if j is not None and j < NEW:
      # a round that feeds the poisoned token stops before it emits anything:
      # at most at the token after it, earlier when the round began before it
      assert i in bad and 0 <= bad[i] <= j
    # A row may also stop without ever emitting the token: a rejected guess of
    # it leaves NaN keys / values in a stale cache slot, which masked attention
    # still multiplies by zero (0 * NaN = NaN). Either way, what was emitted
    # is exactly the clean run's tokens up to the first bad one.
    assert e.value.result.tokens[i] == toks[:bad.get(i, NEW)]
