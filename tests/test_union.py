"""Drafters joined by '+' (`specjax.drafters.union`): the chains-to-tree layout,
greedy identity with the trie walking to whichever part guessed right, the
settings a union refuses, and the registry's '+' names. (Exactness under
sampling: tests/test_exactness_montecarlo.py, a family member and the
negative control of merging sampled guesses.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import batch as batch_lib
from specjax.decoding import speculative as sp
from specjax.drafters.base import Context, Target
from specjax.drafters import registry
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.eagle import Eagle, init_head, prepare
from specjax.drafters.eagle_tree import EagleTree
from specjax.drafters.layer_skip import LayerSkip
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.drafters.replay import AlwaysReject, Replay, replay_params
from specjax.drafters.union import Union, chains_tree, compact
from specjax.errors import ConfigValueError
from specjax.models import transformer
from specjax.models.config import tiny_config

CFG = tiny_config(vocab_size=64, dim=64, num_layers=2, eos_id=-1, max_seq_len=256)
PARAMS = transformer.init(jax.random.PRNGKey(7), CFG)
PROMPTS = [[5, 9, 3, 17, 4, 5, 9, 3], [8, 8, 30], [2]]
NEW = 24


def _eagle3_head(seed=9):
  head = init_head(jax.random.PRNGKey(seed), CFG, fused=True, vocab=jnp.arange(0, CFG.vocab_size, 2))
  head["fc"] = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1),
                                       (CFG.dim, 2 * CFG.dim)) / np.sqrt(2 * CFG.dim)
  return prepare(head, PARAMS, CFG)


def test_chains_tree_merges_equal_prefixes_only_when_asked():
  # two chains of 3: equal first guess, different second; the second chain is 2 long
  cands = jnp.asarray([[[7, 8, 9], [7, 5, 6]]])
  lengths = jnp.asarray([[3, 2]])
  tokens, parent = chains_tree(cands, lengths, merge=True)
  q = jax.nn.one_hot(tokens, 10)
  tokens, parent, q, count = compact(tokens, parent, q)
  # trie: 7 (root's child), then 8 and 5 under it, then 9 under 8
  assert count.tolist() == [4]
  assert tokens[0, :4].tolist() == [7, 8, 5, 9] and parent[0].tolist() == [-1, 0, 0, 1, -2, -2]
  assert np.array_equal(q[0, :4].argmax(-1), tokens[0, :4])  # q travels with its node
  tokens, parent = chains_tree(cands, lengths, merge=False)
  tokens, parent, _, count = compact(tokens, parent, jax.nn.one_hot(tokens, 10))
  # two branches from the root, depth-major: 7 | 7, 8 | 5, 9
  assert count.tolist() == [5]
  assert tokens[0, :5].tolist() == [7, 7, 8, 5, 9] and parent[0].tolist() == [-1, -1, 0, 1, 2, -2]


def test_greedy_union_equals_ar_and_accepts_what_its_best_part_does():
  ref = ar.generate(PARAMS, CFG, PROMPTS, max_new_tokens=NEW).tokens
  head = _eagle3_head()
  union = Union(k=3, parts=(Eagle(k=3, fused=True), PromptLookup(k=3)))
  res = sp.generate(PARAMS, CFG, union, PROMPTS, draft_params=(head, None), max_new_tokens=NEW)
  assert res.tokens == ref
  # a part that always misses first, the AR output replayed second: the trie walks
  # to the replayed branch every round, as the replay alone does
  replay = replay_params(ref)
  alone = sp.generate(PARAMS, CFG, Replay(k=3), PROMPTS, draft_params=replay, max_new_tokens=NEW)
  both = sp.generate(PARAMS, CFG, Union(k=3, parts=(AlwaysReject(k=3, token=63), Replay(k=3))),
                     PROMPTS, draft_params=(None, replay), max_new_tokens=NEW)
  assert both.tokens == ref and alone.tokens == ref
  assert both.stats["rounds"] == alone.stats["rounds"], (both.stats, alone.stats)
  # a replay wrong at every even position (right at the first guess of every round
  # that starts at an odd one, as the first round does) drafted first: merged into
  # a trie, the right replay's guesses hang below the shared first guess and are
  # accepted; as separate branches, greedy walks into the first matching branch
  # and stops at its wrong second guess
  bad = [[t if i % 2 else (t + 1) % CFG.vocab_size for i, t in enumerate(r)] for r in ref]
  params = (replay_params(bad), replay)
  merged = sp.generate(PARAMS, CFG, Union(k=3, parts=(Replay(k=3), Replay(k=3))), PROMPTS,
                       draft_params=params, max_new_tokens=NEW)
  apart = sp.generate(PARAMS, CFG, Union(k=3, parts=(Replay(k=3), Replay(k=3)), merge=False),
                      PROMPTS, draft_params=params, max_new_tokens=NEW)
  assert merged.tokens == ref and apart.tokens == ref
  assert merged.stats["rounds"] == alone.stats["rounds"]
  assert apart.stats["rounds"] > merged.stats["rounds"], (apart.stats, merged.stats)


def test_sampled_parts_draw_with_their_own_keys():
  """Under sampling the tree rule needs the parts' guesses drawn independently:
  part 0 draws with the round's drafting keys (as it would alone), part g >= 1
  with fold_in(keys, g). Two copies of one sampled EAGLE-3 head, kept apart,
  must then propose different chains in some rows; handed the same keys (the
  control: what sharing them would do) they propose the same chain every time.
  Each node carries the q its part drew it from."""
  t1 = sampling_lib.SamplingConfig(temperature=1.0)
  head = _eagle3_head()
  part = Eagle(k=3, fused=True, sampling=t1)
  union = Union(k=3, parts=(part, part), merge=False)
  params = (head, head)
  state = sp.start(PARAMS, CFG, union, PROMPTS, draft_params=params, key=5,
                   spec=sp.SpecConfig(sampling=t1), max_new_tokens=NEW)
  ctx = Context(history=state.history, length=state.length, prompt_len=state.prompt_len,
                active=~state.done)
  target = Target(PARAMS, CFG)
  propose = jax.jit(lambda d, p, s, keys: d.draft(p, target, s, ctx, keys)[0], static_argnums=0)
  differ = 0
  for r in range(8):  # 8 rounds' keys x 3 rows
    keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, jnp.int32(r))
    tree = propose(union, params, state.drafter, keys)
    assert tree.num_proposed.tolist() == [6] * len(PROMPTS)  # two branches of 3, apart
    chains = np.asarray(tree.tokens)[:, :6].reshape(-1, 3, 2)  # depth-major -> (B, depth, part)
    alone = [propose(part, head, state.drafter[0], keys),
             propose(part, head, state.drafter[1],
                     jax.vmap(jax.random.fold_in, (0, None))(keys, 1))]
    q = np.asarray(tree.q)[:, :6].reshape(len(PROMPTS), 3, 2, -1)  # q travels with its node
    for g in range(2):
      np.testing.assert_array_equal(chains[:, :, g], alone[g].tokens)
      np.testing.assert_array_equal(q[:, :, g], alone[g].q)
    shared = propose(part, head, state.drafter[1], keys)  # the control: part 1 on part 0's keys
    np.testing.assert_array_equal(shared.tokens, alone[0].tokens)
    differ += int(np.sum(np.any(chains[:, :, 0] != chains[:, :, 1], axis=1)))
  assert differ >= 8, differ  # of 24 pairs of chains


def test_union_refuses_what_it_cannot_join():
  with pytest.raises(ValueError, match="at least two"):
    Union(k=3, parts=(PromptLookup(k=3),))
  with pytest.raises(ValueError, match="drafts a tree"):
    Union(k=2, parts=(EagleTree(k=2, tree_topk=2, tree_width=1, tree_nodes=3), PromptLookup(k=2)))
  with pytest.raises(ValueError, match="writes into the target's cache"):
    Union(k=2, parts=(LayerSkip(k=2, layers=(0,)), PromptLookup(k=2)))
  with pytest.raises(ValueError, match="own guesses"):
    Union(k=2, parts=(DraftModel(k=2, cfg=CFG), PromptLookup(k=2)))
  with pytest.raises(ValueError, match="need exactly k"):
    Union(k=3, parts=(Eagle(k=2, fused=True), PromptLookup(k=3)))
  Union(k=3, parts=(Eagle(k=3, fused=True), PromptLookup(k=2)))  # a stateless part may draft less
  with pytest.raises(ValueError, match="tuple of 2"):
    Union(k=3, parts=(Eagle(k=3, fused=True), PromptLookup(k=3))).check(CFG, _eagle3_head())
  t1 = sampling_lib.SamplingConfig(temperature=1.0)
  sampled = (Eagle(k=3, fused=True, sampling=t1), PromptLookup(k=3))
  assert Union(k=3, parts=sampled).lossy  # merging sampled guesses (the negative control)
  assert not Union(k=3, parts=sampled, merge=False).lossy
  assert not Union(k=3, parts=(Eagle(k=3, fused=True), PromptLookup(k=3))).lossy


def test_registry_builds_unions_by_name(smollm2):
  drafter, params = registry.make_drafter("eagle3+prompt_lookup@k=3", {}, smollm2)
  assert isinstance(drafter, Union) and drafter.name == "eagle3+prompt_lookup"
  assert drafter.merge and drafter.k == 3 and [p.k for p in drafter.parts] == [3, 3]
  assert isinstance(params, tuple) and params[1] is None and "fc" in params[0]
  assert drafter.layers_for(smollm2.cfg) == drafter.parts[0].layers_for(smollm2.cfg)
  t1 = sampling_lib.SamplingConfig(temperature=1.0)
  drafter, _ = registry.make_drafter("eagle3+prompt_lookup@k=2", {}, smollm2, sampling=t1)
  assert not drafter.merge and not drafter.lossy
  assert registry.is_method("eagle3+prompt_lookup") and not registry.is_method("eagle3+nope")
  assert "eagle3" in registry.drafter_id("eagle3+prompt_lookup", {})
  with pytest.raises(ConfigValueError, match="unknown drafting method 'nope'"):
    registry.make_drafter("prompt_lookup+nope", {}, smollm2)
  with pytest.raises(ConfigValueError, match="does not read 'tree_nodes'"):
    registry.make_drafter("eagle3+prompt_lookup@tree_nodes=8", {}, smollm2)
  with pytest.raises(ConfigValueError, match="own guesses"):
    registry.make_drafter("draft_model+prompt_lookup@k=2@draft_model=self:1", {}, smollm2)
