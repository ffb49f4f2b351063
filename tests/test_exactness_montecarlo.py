"""End-to-end exactness of speculative decoding, and negative controls that fail.

A tiny target and drafters with a vocabulary of 8, sharp enough that the
drafter's q is far from the target's p (TV 0.3-0.6 at the first position, so
rejections happen at every draft position); the whole speculative generate
runs for 10^5 independent requests per setting and the empirical joint law of
the first 4 emitted tokens is compared with the target's exact joint law
(enumerated). The family of positive settings is tested together with Holm's
correction at family-wise level 1e-3; each negative control -- a subtle bug
of the kind shipped by real implementations -- must be rejected.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax import verify
from specjax.analysis import exactness
from specjax.analysis import montecarlo as mc
from specjax.decoding import batch as batch_lib
from specjax.decoding import speculative as sp
from specjax.drafters.draft_model import DraftModel, with_draft_vocab
from specjax.drafters.eagle import Eagle, init_head, prepare
from specjax.drafters.eagle_tree import EagleTree
from specjax.drafters.layer_skip import LayerSkip
from specjax.drafters.lookahead import LookaheadTree
from specjax.drafters.medusa import Blockwise, Medusa, MedusaTree
from specjax.drafters.medusa import prepare as medusa_prepare
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.drafters.union import Union

pytestmark = pytest.mark.slow  # ~30 programs of 10^5 requests: the full suite, not the fast tier

V = 8
M = 4  # joint of the first M tokens: the prefill's token, then speculative rounds
N = 100_000
FAMILY_ALPHA = 1e-3
_TARGET, CFG, _DRAFT, DCFG = mc.tiny_pair(vocab_size=V)
PROMPTS1 = [[3, 5, 1, 6]]
PROMPTS4 = [[3, 5, 1, 6], [2, 7], [4, 4, 1, 3, 4], [6]]  # ragged batch


@pytest.fixture(scope="module")
def models():
  return _TARGET, _DRAFT


T1 = sampling_lib.SamplingConfig(temperature=1.0)
T07 = sampling_lib.SamplingConfig(temperature=0.7)
TOPK = sampling_lib.SamplingConfig(temperature=1.0, top_k=4)
TOPP = sampling_lib.SamplingConfig(temperature=1.0, top_p=0.9)

TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))

# (name, drafter, target sampling, prompts): every drafter, every sampling mode,
# k in {1, 3, 5} and B in {1, 4} each at least once. The draft model samples at
# T = 1 while the target uses other settings: exactness holds for any q.
SETTINGS = [
    # The draft model drafting over a reduced vocabulary (every other token, as
    # a distilled draft model does with draft_vocab=N): q is zero elsewhere.
    ("draft_model-reduced-T1-k3-B1", DraftModel(k=3, cfg=DCFG, sampling=T1), T1, PROMPTS1),
    ("draft_model-T0.7-k1-B4", DraftModel(k=1, cfg=DCFG, sampling=T1), T07, PROMPTS4),
    # Dynamic draft length: each row stops drafting once its confidence
    # product falls below 0.3, verified at the narrowest width holding every row.
    ("draft_model-stop-T1-k3-B4", DraftModel(k=3, cfg=DCFG, sampling=T1, draft_stop=0.3), T1,
     PROMPTS4),
    ("layer_skip-topk-k5-B1", LayerSkip(k=5, layers=(0,), sampling=T1), TOPK, PROMPTS1),
    ("prompt_lookup-topp-k3-B4", PromptLookup(k=3, max_ngram=2), TOPP, PROMPTS4),
    # Medusa heads sample at T = 0.7 for a T = 1 target; blockwise is their
    # top-1 chain (one-hot q) under a top-p target; both from heads with a
    # reduced draft vocabulary (as every Medusa tree below: q zero on half the
    # tokens; the long-horizon PIT test runs the chain on the full vocabulary).
    ("medusa-T1-k3-B4", Medusa(k=3, sampling=T07), T1, PROMPTS4),
    ("blockwise-topp-k2-B1", Blockwise(k=2), TOPP, PROMPTS1),
    # EAGLE heads (true-feature rewrite after every verify, chain on own
    # features); EAGLE-3 with a reduced draft vocabulary: q is zero on half the
    # tokens, so the residual carries all of their mass.
    ("eagle-T1-k3-B4", Eagle(k=3, sampling=T07), T1, PROMPTS4),
    ("eagle3-reduced-topk-k2-B1", Eagle(k=2, sampling=T1, fused=True), TOPK, PROMPTS1),
    # Medusa trees (one verify forward over the tree, accepted path committed):
    # siblings without replacement (Gumbel-top-k), i.i.d. (SpecInfer), and
    # the heads' top-k as deterministic candidates (one-hot q).
    ("medusa_tree-wor-T1-B4", MedusaTree(k=2, choices=TREE, sampling=T07), T1, PROMPTS4),
    ("medusa_tree-iid-topp-B1", MedusaTree(k=2, choices=TREE, tree_mode="iid", sampling=T1), TOPP,
     PROMPTS1),
    ("medusa_tree-topk-T0.7-B1", MedusaTree(k=2, choices=TREE, tree_mode="topk"), T07, PROMPTS1),
    # EAGLE-2 dynamic trees: sampled children kept whole (wor), and EAGLE-3's
    # deterministic top-k candidates reranked to a node budget (reduced vocabulary).
    ("eagle_tree-wor-T1-B4", EagleTree(k=2, tree_topk=3, tree_width=2, sampling=T07), T1, PROMPTS4),
    ("eagle3_tree-topk-T1-B1", EagleTree(k=2, tree_topk=3, tree_width=2, tree_nodes=5, tree_mode="topk",
                                         fused=True, sampling=T1), T1, PROMPTS1),
    # Both exact sampled tree modes under every sampling mode (with the
    # members above: wor at T = 1 and top-p here, T = 0.7 in the PIT test;
    # iid at top-p above, T = 1 and T = 0.7 here).
    ("eagle_tree-wor-topp-B1", EagleTree(k=2, tree_topk=3, tree_width=2, sampling=TOPP), TOPP, PROMPTS1),
    ("medusa_tree-iid-T1-B4", MedusaTree(k=2, choices=TREE, tree_mode="iid", sampling=T1), T1,
     PROMPTS4),
    ("medusa_tree-iid-T0.7-B1", MedusaTree(k=2, choices=TREE, tree_mode="iid", sampling=T07), T07,
     PROMPTS1),
    # Lookahead's G candidates (deterministic, one-hot q) merged into a trie
    # with duplicates marked out of the tree, one tree forward.
    ("lookahead_tree-T0.7-B4", LookaheadTree(k=2, window=2, ngram=3, max_candidates=3, pool_size=16),
     T07, PROMPTS4),
    # A union: EAGLE-3's sampled chain and prompt lookup's deterministic one as
    # two branches of one tree (not merged: SpecInfer's multi-step rule over
    # independently drawn candidates, each with its own q).
    ("union-eagle3+prompt_lookup-T1-B4",
     Union(k=2, parts=(Eagle(k=2, sampling=T1, fused=True), PromptLookup(k=2, max_ngram=1)),
           merge=False), T1, PROMPTS4),
]


def _random_heads(num_heads=3, scale=3.0, seed=5):
  """Untrained-looking heads far from the identity, so q differs from p."""
  kw, kb = jax.random.split(jax.random.PRNGKey(seed))
  d = CFG.dim
  return {"w": scale * jax.random.normal(kw, (num_heads, d, d)) / np.sqrt(d),
          "b": jax.random.normal(kb, (num_heads, d))}


HEADS = _random_heads()
# The same heads drafting over every other token (a reduced draft vocabulary,
# the target's LM-head rows of those tokens gathered as a loaded checkpoint has them).
HEADS_REDUCED = medusa_prepare(dict(HEADS, vocab=jnp.arange(0, V, 2)), _TARGET, CFG)


def _random_eagle(fused, scale=0.5, seed=9):
  """A random EAGLE head whose q is far from p (TV ~0.45-0.9 on these prompts)."""
  head = init_head(jax.random.PRNGKey(seed), CFG, fused=fused,
                   vocab=jnp.arange(0, V, 2) if fused else None)
  d = CFG.dim
  head["fc"] = scale * jax.random.normal(jax.random.PRNGKey(seed + 1), (d, 2 * d)) / np.sqrt(2 * d)
  if fused:
    head["norm"] = jnp.full((d,), scale)
  return prepare(head, _TARGET, CFG)


EAGLE_HEADS = {False: _random_eagle(False), True: _random_eagle(True)}


REDUCED_DRAFT = with_draft_vocab(dict(_DRAFT, vocab_rank=jnp.arange(V)), DCFG, V // 2)


def _draft_params(drafter, draft, name=None):
  if isinstance(drafter, Union):
    return tuple(_draft_params(p, draft) for p in drafter.parts)
  if name is not None and name.startswith("draft_model-reduced"):
    return REDUCED_DRAFT
  if isinstance(drafter, Eagle):
    return EAGLE_HEADS[drafter.fused]
  if name is not None and isinstance(drafter, Medusa):  # the family: a reduced vocabulary
    return HEADS_REDUCED
  if isinstance(drafter, MedusaTree):
    return HEADS_REDUCED
  if isinstance(drafter, Medusa):  # the PIT's chain: the full vocabulary
    return HEADS
  return draft if isinstance(drafter, DraftModel) else None


def run_setting(models, drafter, sampling, prompts, spec=None, num=N, seed=0, name=None):
  target, draft = models
  spec = spec or sp.SpecConfig(sampling=sampling)
  samples, stats = mc.sample_tokens(target, CFG, drafter, prompts, num // len(prompts), M,
                                    draft_params=_draft_params(drafter, draft, name), seed=seed,
                                    spec=spec)
  results = [mc.joint_test(s, mc.exact_joint(target, CFG, p, M, sampling))
             for s, p in zip(samples, prompts)]
  return results, stats


@pytest.fixture(scope="module")
def family(models):
  return {name: run_setting(models, d, s, p, name=name) for name, d, s, p in SETTINGS}


def test_drafts_are_far_from_the_target(models):
  """Guard: a near-uniform or near-identical pair would hide residual bugs."""
  target, draft = models
  for prompt in PROMPTS4:
    p = mc._teacher_forced_probs(target, CFG, jnp.asarray([prompt]), T1)[0, -1]
    q = mc._teacher_forced_probs(draft, DCFG, jnp.asarray([prompt]), T1)[0, -1]
    tv = float(exactness.tv_distance(np.asarray(p, np.float64), np.asarray(q, np.float64)))
    assert 0.3 <= tv <= 0.6, tv


def test_family_is_exact_with_holm_correction(family):
  pvalues, names = [], []
  for name, (results, _) in family.items():
    for i, r in enumerate(results):
      pvalues.append(r.pvalue)
      names.append(f"{name}[prompt {i}]")
      assert r.tv < r.tv_bound, (name, r)
  rejected = exactness.holm_bonferroni(np.array(pvalues), FAMILY_ALPHA)
  report = {n: (round(p, 4)) for n, p in zip(names, pvalues)}
  assert not rejected.any(), report


def test_every_draft_position_sees_rejections(family):
  """Within the M tokens compared, every guess position is evaluated and sees
  both outcomes (positions beyond M - 1 are covered by the PIT test)."""
  for name, (_, stats) in family.items():
    acc = np.asarray(stats["per_position_acceptance"])[:M - 1]
    if name.startswith(("prompt_lookup", "lookahead")):
      acc = acc[:1]  # n-gram proposals rarely run to full length on V = 8
    if name.startswith(("medusa", "blockwise")):
      # Heads have no feature before the first verify: the first round proposes
      # nothing, so within M tokens the second round evaluates 2 positions.
      acc = acc[:2]
    assert np.all((acc > 0) & (acc < 1)), (name, acc)


# ---- long horizon: bonus tokens, all-accept rounds and catch-up all occur ----

L = 18  # >= 3 (k + 1) for k = 5
PIT_N = 20_000


def run_pit(models, drafter, sampling, spec=None, seed=2):
  target, draft = models
  spec = spec or sp.SpecConfig(sampling=sampling)
  samples, stats = mc.sample_tokens(target, CFG, drafter, PROMPTS1, PIT_N, L,
                                    draft_params=_draft_params(drafter, draft), seed=seed,
                                    spec=spec)
  values = mc.pit_values(target, CFG, PROMPTS1[0], samples[0], sampling, seed=seed)
  return mc.pit_test(values), stats


@pytest.mark.parametrize("drafter,sampling", [
    (LayerSkip(k=5, layers=(0,), sampling=T1), TOPK),
    (DraftModel(k=3, cfg=DCFG, sampling=T1), T07),
    (Medusa(k=3, sampling=T1), T07),
    (Eagle(k=3, sampling=T1, fused=True), T07),
    (MedusaTree(k=2, choices=TREE, sampling=T1), T07),
], ids=["layer_skip-k5-topk", "draft_model-k3-T0.7", "medusa-k3-T0.7", "eagle3-reduced-k3-T0.7",
        "medusa_tree-wor-T0.7"])
def test_long_horizon_pit_is_uniform(models, drafter, sampling):
  result, stats = run_pit(models, drafter, sampling)
  acc = np.asarray(stats["per_position_acceptance"])
  assert np.all((acc > 0) & (acc < 1)), acc  # every position: accepts and rejections
  pvalues = np.append(result.per_position_pvalues, result.pooled_pvalue)
  assert not exactness.holm_bonferroni(pvalues, FAMILY_ALPHA).any(), pvalues


def test_long_horizon_pit_rejects_bonus_from_q(models):
  spec = sp.SpecConfig(sampling=T1, rule=_RULES["bonus_from_q"])
  result, _ = run_pit(models, DraftModel(k=1, cfg=DCFG, sampling=T1), T1, spec=spec)
  assert result.pooled_pvalue < 1e-6, result


def test_smallest_detectable_tv_is_stated(family):
  r = family["draft_model-reduced-T1-k3-B1"][0][0]
  assert r.detectable_tv < 0.25, r  # what the test can see at N = 1e5


# ---- negative controls: each is a real bug; the same test must reject it ----

def _draw(dist, u):
  return sampling_lib.inverse_cdf(dist, u)


def _buggy_rule(kind):
  def rule(keys, tokens, q, p, num_proposed, logits):
    b, k = tokens.shape
    u_acc, u_draw = verify.chain_uniforms(keys, k)
    q_x = jnp.take_along_axis(q, tokens[..., None], -1)[..., 0]
    p_x = jnp.take_along_axis(p[:, :k], tokens[..., None], -1)[..., 0]
    if kind == "ignore_q":
      keep = u_acc < p_x
    else:
      keep = u_acc * q_x < p_x
    keep &= jnp.arange(k)[None] < num_proposed[:, None]
    n = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
    q_n = jnp.take_along_axis(q, jnp.minimum(n, k - 1)[:, None, None], 1)[:, 0]
    if kind == "raw_p_residual":
      raw = jax.nn.softmax(jnp.take_along_axis(logits, n[:, None, None], 1)[:, 0], -1)
      residual = jnp.maximum(raw - q_n, 0.0)
    else:
      residual = jnp.maximum(p_n - q_n, 0.0)
    rejected = n < num_proposed
    if kind == "unnormalised_residual":
      # u compared with the raw cumulative residual mass: no renormalisation.
      cdf = jnp.cumsum(residual, -1)
      res_tok = jnp.minimum(jnp.sum(cdf <= u_draw[:, None], -1), V - 1).astype(jnp.int32)
    else:
      res_tok = _draw(residual, u_draw)
    bonus_dist = q_n if kind == "bonus_from_q" else p_n
    bonus_tok = _draw(bonus_dist, u_draw)
    return n, jnp.where(rejected, res_tok, bonus_tok)
  return rule


@dataclasses.dataclass(frozen=True)
class _KeepIfSure(DraftModel):
  """The classic dynamic-length bug: a guess is kept only if the confidence
  product INCLUDING its own probability clears the threshold, so guesses are
  selected by their own values and are no longer distributed as q."""

  keep_above: float = 0.3

  def draft(self, params, target, state, ctx, keys):
    prop, state = super().draft(params, target, state, ctx, keys)
    conf = jnp.take_along_axis(prop.q, prop.tokens[..., None], -1)[..., 0]
    sure = jnp.cumprod(conf, axis=1) >= self.keep_above
    num = jnp.minimum(prop.num_proposed, jnp.sum(jnp.cumprod(sure.astype(jnp.int32), 1), 1))
    return prop.replace(num_proposed=num), state


_RULES = {kind: _buggy_rule(kind) for kind in
          ("unnormalised_residual", "ignore_q", "bonus_from_q", "raw_p_residual", "correct")}

NEGATIVE = [
    ("unnormalised_residual", DraftModel(k=3, cfg=DCFG, sampling=T1), T1,
     dict(rule=_RULES["unnormalised_residual"])),
    ("ignore_q", DraftModel(k=3, cfg=DCFG, sampling=T1), T1, dict(rule=_RULES["ignore_q"])),
    ("bonus_from_q", DraftModel(k=1, cfg=DCFG, sampling=T1), T1, dict(rule=_RULES["bonus_from_q"])),
    ("raw_p_residual", DraftModel(k=3, cfg=DCFG, sampling=T1), TOPK,
     dict(rule=_RULES["raw_p_residual"])),
    ("key_reused_for_draft_and_accept", DraftModel(k=3, cfg=DCFG, sampling=T1), T1,
     dict(accept_purpose=batch_lib.DRAFT)),
    ("draft_length_chosen_by_own_confidence", _KeepIfSure(k=3, cfg=DCFG, sampling=T1), T1, {}),
    # A union merging a sampled guess into an equal deterministic one (a trie, as
    # under greedy): the sampled candidate's own rejection step is lost, and with
    # it the residual's update by its q (`Union.lossy` says so).
    ("union_merges_sampled_guesses",
     Union(k=2, parts=(PromptLookup(k=2, max_ngram=1), Eagle(k=2, sampling=T1, fused=True))),
     T1, {}),
]


@pytest.mark.parametrize("name,drafter,sampling,spec_kw", NEGATIVE, ids=[n[0] for n in NEGATIVE])
def test_negative_control_is_rejected(models, name, drafter, sampling, spec_kw):
  spec = sp.SpecConfig(sampling=sampling, **spec_kw)
  results, _ = run_setting(models, drafter, sampling, PROMPTS1, spec=spec, num=N // 2, seed=1)
  assert results[0].pvalue < 1e-6, (name, results[0])


# The fixed-top-k dispute, measured. EAGLE-2's "q = 1" rule for top-k
# candidates is the 'topk' mode above (one-hot q: exact, in the family). Its
# mistaken reading -- the same deterministic top-k candidates tested with the
# drafter's q as if they had been sampled from it ('topk_q', opt-in, labelled
# lossy) -- must be rejected; the TV distance of its output from the target's
# is printed (pytest -s) for the record.
LOSSY_TREES = [
    ("medusa_tree-topk_q-T1", MedusaTree(k=2, choices=TREE, tree_mode="topk_q", sampling=T1), T1),
    ("eagle3_tree-topk_q-T1", EagleTree(k=2, tree_topk=3, tree_width=2, tree_nodes=5, tree_mode="topk_q",
                                        fused=True, sampling=T1), T1),
]


@pytest.mark.parametrize("name,drafter,sampling", LOSSY_TREES, ids=[n[0] for n in LOSSY_TREES])
def test_fixed_topk_with_drafter_q_is_rejected(models, name, drafter, sampling):
  assert drafter.lossy and sp.is_lossy(drafter, sp.SpecConfig(sampling=sampling))
  assert not sp.is_lossy(drafter, sp.SpecConfig())  # greedy verification ignores q
  results, _ = run_setting(models, drafter, sampling, PROMPTS1, num=N // 2, seed=1)
  r = results[0]
  print(f"{name}: TV(empirical joint of {M} tokens, target's) = {r.tv:.4f} "
        f"(bound for an exact sampler {r.tv_bound:.4f}), p = {r.pvalue:.2e}")
  assert r.pvalue < 1e-6, (name, r)
  assert r.tv > r.tv_bound, (name, r)


def test_reference_rule_through_the_same_hook_passes(models):
  """The hand-written rule used for the controls, unbroken, is accepted: the
  controls fail because of their bug, not because of the hook."""
  spec = sp.SpecConfig(sampling=T1, rule=_RULES["correct"])
  results, _ = run_setting(models, DraftModel(k=3, cfg=DCFG, sampling=T1), T1, PROMPTS1,
                           spec=spec, num=N // 2, seed=1)
  assert results[0].pvalue > FAMILY_ALPHA, results[0]
