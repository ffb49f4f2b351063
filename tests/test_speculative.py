"""The speculative loop on tiny random models: greedy identity, ragged rows,
EOS / limit cuts, per-request randomness, drafter state, bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import batch as batch_lib
from specjax.decoding import speculative as sp
from specjax.drafters.base import Context
from specjax.drafters.draft_model import DraftModel, DraftModelState
from specjax.drafters.layer_skip import LayerSkip, parse_layers
from specjax.drafters.prompt_lookup import PromptLookup, find_continuation
from specjax.drafters.replay import AlwaysReject, Replay, replay_params
from specjax.models import transformer
from specjax.models.config import tiny_config

CFG = tiny_config(eos_id=-1, pad_id=0)
DCFG = tiny_config(num_layers=1, eos_id=-1, pad_id=0)
PROMPTS = [[5, 9, 13], [7, 11, 3, 20, 31, 8, 4], [17]]
NEW = 12


@pytest.fixture(scope="module")
def target():
  p = transformer.init(jax.random.key(1), CFG)
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


@pytest.fixture(scope="module")
def draft():
  p = transformer.init(jax.random.key(2), DCFG)
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


@pytest.fixture(scope="module")
def reference(target):
  return ar.generate(target, CFG, PROMPTS, max_new_tokens=NEW).tokens


def drafters(target_params, draft_params, ref):
  return [
      (DraftModel(k=3, cfg=DCFG), draft_params),
      (DraftModel(k=2, cfg=CFG), target_params),  # the target as its own drafter: all accept
      (LayerSkip(k=3, layers=(0,)), None),
      (PromptLookup(k=3), None),
      (Replay(k=4), replay_params(ref)),
      (AlwaysReject(k=2), None),
  ]


def test_greedy_is_identical_to_ar_for_every_drafter(target, draft, reference):
  for drafter, dparams in drafters(target, draft, reference):
    res = sp.generate(target, CFG, drafter, PROMPTS, draft_params=dparams, max_new_tokens=NEW)
    assert res.tokens == reference, drafter.name
    assert res.stats["emitted"] == sum(len(t) - 1 for t in reference)
    assert not res.lossy


def test_shared_prompt_forwards_change_nothing(target, draft, reference):
  """AR and every drafter on one PromptForwards: the same tokens, each distinct
  prompt forward run once (its cache copied per run: the loops consume theirs),
  another params object never served an entry of the first."""
  forwards = ar.PromptForwards()
  assert ar.generate(target, CFG, PROMPTS, max_new_tokens=NEW,
                     prompt_forwards=forwards).tokens == reference
  runs = drafters(target, draft, reference)
  for drafter, dparams in runs + runs[:1]:  # the first again: its entry served twice
    res = sp.generate(target, CFG, drafter, PROMPTS, draft_params=dparams, max_new_tokens=NEW,
                      prompt_forwards=forwards)
    assert res.tokens == reference, drafter.name
  slots = {ar.prepare(CFG, PROMPTS, NEW, b)[-1] for b in
           [1] + [max(d.k + 1, d.block) for d, _ in runs]}
  assert forwards.computed == len(slots) and forwards.computed + forwards.reused == len(runs) + 2
  other = jax.tree.map(lambda x: x * 1.0, target)  # equal values, another object
  before = forwards.computed
  assert ar.generate(other, CFG, PROMPTS, max_new_tokens=NEW,
                     prompt_forwards=forwards).tokens == reference
  assert forwards.computed == before + 1


def test_acceptance_metrics(target, draft, reference):
  self_draft = sp.generate(target, CFG, DraftModel(k=2, cfg=CFG), PROMPTS, draft_params=target,
                           max_new_tokens=NEW)
  assert self_draft.alpha == 1.0
  replay = sp.generate(target, CFG, Replay(k=4), PROMPTS, draft_params=replay_params(reference),
                       max_new_tokens=NEW)
  assert replay.alpha == 1.0
  with pytest.raises(ValueError, match="replay: 4 reference continuations for a batch of 3 rows"):
    sp.generate(target, CFG, Replay(k=4), PROMPTS, max_new_tokens=NEW,
                draft_params=replay_params(reference + reference[:1]))
  # 11 decode tokens per row at 5 per round: rounds of 5, 5, 1.
  assert replay.stats["rounds"] == 3 * 3
  assert replay.stats["accept_hist"][4] == 2 * 3
  # Every round emits its accepted guesses and one more token: the correction
  # after a rejection, the bonus after all-accept (nothing here is cut by EOS).
  reject = sp.generate(target, CFG, AlwaysReject(k=2, token=63), PROMPTS, max_new_tokens=NEW)
  assert reject.alpha == 0.0 and reject.tau == 1.0
  assert reject.stats["per_position_acceptance"] == [0.0, 0.0]
  # ... a round that accepts all 4 guesses emits them and a bonus token: 4 + 4
  # accepted, then 1 (the last token, cut at the limit). Without the bonus the
  # rows would need 4 + 4 + 3.
  assert replay.stats["emitted"] == 3 * 11 and replay.stats["accepted"] == 3 * (4 + 4 + 1)


def test_dynamic_draft_length(target, draft, reference):
  """Rows stop drafting once their confidence product falls below the
  threshold: greedy output unchanged, verifies narrower (the loop picks the
  narrowest width holding every row's proposal); a negligible threshold is
  the fixed-length chain."""
  full = sp.generate(target, CFG, DraftModel(k=3, cfg=DCFG), PROMPTS, draft_params=draft,
                     max_new_tokens=NEW)
  assert full.stats["verified_tokens"] == 4 * full.stats["rounds"]
  dyn = sp.generate(target, CFG, DraftModel(k=3, cfg=DCFG, draft_stop=0.6), PROMPTS,
                    draft_params=draft, max_new_tokens=NEW)
  assert dyn.tokens == reference
  assert 2 * dyn.stats["rounds"] <= dyn.stats["verified_tokens"] < 4 * dyn.stats["rounds"]
  tiny = sp.generate(target, CFG, DraftModel(k=3, cfg=DCFG, draft_stop=1e-30), PROMPTS,
                     draft_params=draft, max_new_tokens=NEW)
  assert tiny.tokens == reference and tiny.stats == full.stats
  for bad in (-0.1, 1.0):
    with pytest.raises(ValueError, match="draft_stop"):
      DraftModel(k=3, cfg=DCFG, draft_stop=bad)


def test_eos_and_limits_cut_accepted_blocks(target, reference):
  row = reference[1]
  # An EOS that lands inside an accepted replay block: a token first seen at j >= 3.
  j = next(i for i in range(3, len(row)) if row[i] not in row[:i])
  eos = row[j]
  cfg = CFG.replace(eos_id=eos)
  want = ar.generate(target, cfg, PROMPTS, max_new_tokens=[12, 12, 7]).tokens
  got = sp.generate(target, cfg, Replay(k=4), PROMPTS, draft_params=replay_params(reference),
                    max_new_tokens=[12, 12, 7])
  assert got.tokens == want
  assert got.tokens[1][-1] == eos and len(got.tokens[1]) == j + 1
  # Cut tokens count in no metric: emitted == what was returned (minus prefill's).
  assert got.stats["emitted"] == sum(len(t) - 1 for t in want)


def test_sampled_rows_are_per_request(target, draft):
  spec = sp.SpecConfig(sampling=sampling_lib.SamplingConfig(temperature=1.0))
  drafter = DraftModel(k=3, cfg=DCFG, sampling=sampling_lib.SamplingConfig(temperature=1.0))
  run = functools.partial(sp.generate, target, CFG, drafter, draft_params=draft, spec=spec,
                          max_new_tokens=NEW, key=3)
  batch = run(PROMPTS)
  assert run(PROMPTS).tokens == batch.tokens  # deterministic
  alone = run([PROMPTS[1]], request_ids=[1])
  assert alone.tokens[0] == batch.tokens[1]
  swapped = run(PROMPTS[::-1], request_ids=[2, 1, 0])
  assert swapped.tokens == batch.tokens[::-1]


def _state_after_rounds(target, drafter, dparams, prompts, rounds):
  tokens, lengths, limits, width, slots = ar.prepare(CFG, prompts, 40, drafter.k + 1)
  keys = batch_lib.request_keys(jax.random.key(0), jnp.arange(len(prompts)))
  spec = sp.SpecConfig()
  state = sp.prefill(target, CFG, drafter, dparams, keys, jnp.asarray(tokens),
                     jnp.asarray(lengths), jnp.asarray(limits), num_slots=slots, spec=spec,
                     max_new_tokens=width)
  step = jax.jit(sp.spec_round, static_argnums=(1, 2, 4))
  for _ in range(rounds):
    state = step(target, CFG, drafter, dparams, spec, state)
  return state, slots


def _fresh_proposal(target, drafter, dparams, state, slots):
  """A drafter prefilled from scratch on each row's committed history."""
  hist, length = np.asarray(state.history), np.asarray(state.length)
  prompts = [hist[b, :length[b] - 1].tolist() for b in range(len(length))]
  toks, lens = batch_lib.pad_prompts(prompts, CFG.pad_id, bucket=slots)
  fresh = drafter.init(dparams, None, jnp.asarray(toks), jnp.asarray(lens), slots)
  ctx = Context(history=state.history, length=state.length, prompt_len=state.prompt_len,
                active=jnp.ones_like(state.done))
  keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, state.round)
  return drafter.propose(dparams, None, fresh, ctx, state.cache, keys)[0]


def _live_proposal(target, drafter, dparams, state):
  ctx = Context(history=state.history, length=state.length, prompt_len=state.prompt_len,
                active=jnp.ones_like(state.done))
  keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, state.round)
  return drafter.propose(dparams, None, state.drafter, ctx, state.cache, keys)[0]


@pytest.mark.parametrize("case", ["reject_at_0", "all_accept", "mixed"])
def test_draft_model_state_equals_fresh_prefill(target, draft, case):
  """After rounds ending in a rejection at 0, mid-chain or all-accept, the
  drafter's next proposal and q equal a drafter prefilled on the committed
  prefix: catch-up fed exactly the 1-2 tokens it missed."""
  if case == "all_accept":
    drafter, dparams = DraftModel(k=3, cfg=CFG), target
  else:
    drafter, dparams = DraftModel(k=3, cfg=DCFG), draft
  state, slots = _state_after_rounds(target, drafter, dparams, PROMPTS, 3)
  hist = np.asarray(state.metrics.accept_hist).sum(0)
  if case == "all_accept":
    assert hist[3] > 0 and hist[:3].sum() == 0
  elif case == "reject_at_0":
    assert hist[0] > 0
  live = _live_proposal(target, drafter, dparams, state)
  fresh = _fresh_proposal(target, drafter, dparams, state, slots)
  np.testing.assert_array_equal(live.tokens, fresh.tokens)
  np.testing.assert_allclose(live.q, fresh.q, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class SkipsBonusCatchUp(DraftModel):
  """Negative control: after an all-accept round it feeds only one of the two
  tokens it missed (its own last guess), never the bonus token."""

  def draft(self, params, target, state, ctx, keys):
    lagging = ctx.replace(length=jnp.minimum(ctx.length, state.cache.length + 1))
    return super().draft(params, target, state, lagging, keys)


def test_catch_up_negative_control_is_caught(target):
  drafter = SkipsBonusCatchUp(k=3, cfg=CFG)
  state, slots = _state_after_rounds(target, drafter, target, PROMPTS, 2)
  live = _live_proposal(target, drafter, target, state)
  fresh = _fresh_proposal(target, DraftModel(k=3, cfg=CFG), target, state, slots)
  assert not np.allclose(live.q, fresh.q, atol=1e-3)


def test_prompt_lookup_finds_latest_match():
  hist = jnp.array([[1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 0, 0]], jnp.int32)
  start, found = find_continuation(hist, jnp.array([10]), 2)  # last 2-gram (1, 2)
  assert bool(found[0]) and int(start[0]) == 6  # after the most recent earlier (1, 2)
  start, found = find_continuation(hist, jnp.array([4]), 2)  # (9, 1)... no earlier match
  assert not bool(found[0])


def test_layer_spec_parsing():
  assert parse_layers("0-3,8", 30) == (0, 1, 2, 3, 8)
  assert parse_layers("every10", 30) == (0, 10, 20)
  with pytest.raises(ValueError, match="layers in"):
    parse_layers("0-40", 30)


def test_bad_input_is_refused(target, draft):
  with pytest.raises(ValueError, match="vocabulary"):
    sp.generate(target, CFG, DraftModel(k=2, cfg=DCFG.replace(vocab_size=32)), PROMPTS,
                draft_params=draft)
  with pytest.raises(ValueError, match="k must be"):
    PromptLookup(k=0)
  with pytest.raises(ValueError, match="not loaded"):
    sp.generate(target, CFG, DraftModel(k=2, cfg=DCFG), PROMPTS, draft_params=None)
  with pytest.raises(ValueError, match="cache slots"):
    sp.generate(target, CFG, PromptLookup(k=8), [list(range(3, 40))], max_new_tokens=20,
                cache_slots=64)
  with pytest.raises(ValueError, match="rule"):
    sp.SpecConfig(rule="optimistic")
  with pytest.raises(ValueError, match="does not exist"):
    sp.generate(target, CFG, LayerSkip(k=2, layers=(0, 5)), PROMPTS)
