"""Lookahead decoding drafter on a tiny model: the window forward against a
causal reference, the n-gram pool on hand-made inputs, and lossless
speculative generation (greedy equals AR, sampled runs reproducible)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative
from specjax.drafters import lookahead as la
from specjax.drafters.base import Target
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import tiny_config

# An untied LM head lets `periodic_params` build a target with a known output.
CFG = tiny_config(eos_id=2, pad_id=0, tie_embeddings=False)
# One drafter, one token budget, prompts of at most 7 tokens: every generation
# below reuses the same compiled prefill / decode.
DRAFTER = la.Lookahead(k=2, window=4, ngram=3, max_candidates=4, pool_size=32)
NEW = 24
PROMPTS = [[5, 9, 13], [7, 11, 3, 20, 31, 8, 4], [17]]
SHORT = [3, 4, 5, 6, 7]  # period 5
LONG = list(range(10, 40))  # period 30 (> NEW: generated text never repeats)


@pytest.fixture(scope="module")
def params():
  @functools.partial(jax.jit, static_argnums=1)
  def init(key, cfg):  # one compile instead of many eager ops
    p = transformer.init(key, cfg)
    return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)  # non-uniform outputs

  return init(jax.random.key(1), CFG)


def successor() -> np.ndarray:
  succ = np.arange(CFG.vocab_size)
  for cycle in (SHORT, LONG):
    succ[cycle] = cycle[1:] + cycle[:1]
  return succ


@pytest.fixture(scope="module")
def periodic(params):
  """A target whose greedy next token is succ(current token): the blocks add
  nothing to the residual stream (wo = w_down = 0) and the LM head row (out, in)
  of succ(x) is x's embedding."""
  p = jax.tree.map(lambda x: x, params)
  p["layers"] = [dict(l, wo=jnp.zeros_like(l["wo"]), w_down=jnp.zeros_like(l["w_down"]))
                 for l in p["layers"]]
  p["lm_head"] = jnp.zeros_like(p["lm_head"]).at[successor()].set(p["embed"])
  return p


def follow(prompt, n):
  succ, out, x = successor(), [], prompt[-1]
  for _ in range(n):
    x = int(succ[x])
    out.append(x)
  return out


# --- settings ---------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(window=0), dict(ngram=1), dict(max_candidates=0),
                                dict(max_candidates=9, pool_size=8), dict(k=0),
                                dict(select="oldest"), dict(window=2.0)])
def test_bad_settings_raise(kw):
  with pytest.raises(ValueError):
    la.Lookahead(**kw)


def test_defaults():
  d = la.Lookahead(window=5, ngram=4)
  assert d.k == 3 and d.block == 15
  assert la.Lookahead(window=2, ngram=2, k=5).block == 6
  assert hash(d) == hash(la.Lookahead(window=5, ngram=4))  # a jit-static argument


def test_lookahead_mask():
  want = np.array([[1, 0, 0, 0, 0, 0],  # level 0: causal
                   [1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0],
                   [1, 0, 0, 1, 0, 0],  # level 1, column i: level 0 up to i, itself
                   [1, 1, 0, 0, 1, 0],
                   [1, 1, 1, 0, 0, 1]], bool)
  np.testing.assert_array_equal(la.lookahead_mask(3, 3), want)


# --- the n-gram pool ----------------------------------------------------------


M = 6  # n-grams per insert, padded with invalid ones: one compiled shape
_pool_insert = jax.jit(la.pool_insert)
_pool_lookup = jax.jit(la.pool_lookup, static_argnames=("num", "select"))


def _insert(pool, grams, valid=None):
  valid = [True] * len(grams) if valid is None else valid
  g = np.zeros((1, M, 3), np.int32)
  g[0, :len(grams)] = grams
  v = np.zeros((1, M), bool)
  v[0, :len(valid)] = valid
  return _pool_insert(pool, jnp.asarray(g[..., 0]), jnp.asarray(g[..., 1:]), jnp.asarray(v))


def _lookup(pool, token, num=4, select="recent"):
  cont, found = _pool_lookup(pool, jnp.asarray([token], jnp.int32), num=num, select=select)
  return [c for c, f in zip(np.asarray(cont[0]).tolist(), np.asarray(found[0])) if f]


def test_pool_insert_and_lookup():
  pool = la.empty_pool(1, 4, 3)
  assert _lookup(pool, 5) == []
  pool = _insert(pool, [(5, 6, 7), (5, 8, 9), (6, 7, 8)])
  assert _lookup(pool, 5) == [[8, 9], [6, 7]]  # most recent first
  assert _lookup(pool, 6) == [[7, 8]]
  # A sighting refreshes and counts; invalid entries are ignored.
  pool = _insert(pool, [(5, 6, 7), (1, 2, 3)], valid=[True, False])
  assert _lookup(pool, 5) == [[6, 7], [8, 9]] and _lookup(pool, 1) == []
  pool = _insert(pool, [(5, 8, 9), (5, 8, 9)])  # twice in one batch: stored once
  pool = _insert(pool, [(5, 1, 1)])
  assert _lookup(pool, 5) == [[1, 1], [8, 9], [6, 7]]
  assert _lookup(pool, 5, select="frequent") == [[8, 9], [6, 7], [1, 1]]  # 3, 2, 1 sightings
  # Full: new n-grams replace the least recently seen, (6 7 8) then (5 6 7).
  pool = _insert(pool, [(7, 7, 7), (8, 8, 8)])
  assert _lookup(pool, 6) == [] and _lookup(pool, 5) == [[1, 1], [8, 9]]
  assert _lookup(pool, 7) == [[7, 7]] and _lookup(pool, 8) == [[8, 8]]
  # More new n-grams than slots: the last ones win.
  pool = _insert(pool, [(10 + j, j, j) for j in range(6)])
  assert [bool(_lookup(pool, 10 + j)) for j in range(6)] == [False] * 2 + [True] * 4


def test_pool_rows_are_independent():
  pool = la.empty_pool(2, 4, 3)
  g = jnp.asarray([[[3, 4, 4], [3, 5, 5]], [[3, 6, 6], [9, 9, 9]]], jnp.int32)
  pool = _pool_insert(pool, g[..., 0], g[..., 1:], jnp.asarray([[True, True], [True, False]]))
  cont, found = _pool_lookup(pool, jnp.asarray([3, 3]), num=4, select="recent")
  assert np.asarray(found).tolist() == [[True, True, False, False], [True, False, False, False]]
  assert np.asarray(cont)[0, :2, 0].tolist() == [5, 4] and int(cont[1, 0, 0]) == 6


@pytest.mark.parametrize("next_token", [True, False])
def test_choice_of_the_single_proposal(next_token):
  """Candidates for `last` = 5, most recent first: (6 7), (8 9). With
  next-token ranking the first candidate agreeing with the target's greedy
  next token wins; if none agrees, that token and its own best continuation."""
  d = la.Lookahead(k=2, window=2, ngram=3, max_candidates=4, pool_size=4, next_token=next_token)
  pool = _insert(la.empty_pool(1, 4, 3), [(5, 8, 9), (5, 6, 7), (4, 3, 1)])
  choose = lambda nxt: [np.asarray(x[0]).tolist() for x in
                        d.choose(pool, jnp.asarray([5]), jnp.asarray([nxt]))]
  if next_token:
    assert choose(6) == [[6, 7], 2]
    assert choose(8) == [[8, 9], 2]
    assert choose(4) == [[4, 3], 2]  # no candidate agrees; 4 has a continuation
    tokens, num = choose(9)  # nor does 9, which has none: propose 9 alone
    assert tokens[0] == 9 and num == 1
  else:
    assert choose(8) == [[6, 7], 2]  # the pool's best, whatever the next token
  empty = d.choose(la.empty_pool(1, 4, 3), jnp.asarray([5]), jnp.asarray([8]))
  assert int(empty[1][0]) == (1 if next_token else 0)


# --- the window forward -------------------------------------------------------

WIDTH = 32


@functools.partial(jax.jit, static_argnames=("cfg",))
def _causal_logits(params, cfg, buf):
  c = cache_lib.init_cache(cfg, 1, WIDTH)
  logits, _, _ = transformer.forward(params, cfg, buf, jnp.arange(WIDTH)[None], c)
  return logits[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill(params, cfg, prefix):
  b, t = prefix.shape
  c = cache_lib.init_cache(cfg, b, WIDTH)
  return transformer.forward(params, cfg, prefix, jnp.broadcast_to(jnp.arange(t), (b, t)), c)[2]


def _greedy_after(params, seq):
  """Greedy next token after `seq`, from a cache-less causal forward."""
  buf = np.zeros((1, WIDTH), np.int32)
  buf[0, :len(seq)] = seq
  return int(jnp.argmax(_causal_logits(params, CFG, jnp.asarray(buf))[len(seq) - 1]))


def test_window_forward_gives_each_column_its_contiguous_context(params):
  """(level l, column i) at position length-1+l+i sees exactly last, level 0
  columns 1..i and its own column below it: the top output of column i is
  the causal model's next token after that sequence."""
  n, w = 4, 3
  history = [[5, 9, 13, 21, 8], [7, 11, 3]]  # ragged rows
  lengths = jnp.asarray([len(h) for h in history], jnp.int32)
  prefix = np.zeros((2, 8), np.int32)
  for b, h in enumerate(history):
    prefix[b, :len(h) - 1] = h[:-1]  # the cache holds history[:length - 1]
  cache = _prefill(params, CFG, jnp.asarray(prefix)).with_length(lengths - 1)
  window = np.array(jax.random.randint(jax.random.key(3), (2, n - 1, w), 3, 64))
  window[:, 0, 0] = [h[-1] for h in history]
  step = jax.jit(la.jacobi_step)
  nxt, top, out_cache = step(Target(params, CFG), jnp.asarray(window), lengths, cache,
                             jnp.asarray([True, True]))
  np.testing.assert_array_equal(out_cache.length, lengths - 1 + (n - 1) * w)
  for b, h in enumerate(history):
    assert int(nxt[b]) == _greedy_after(params, h)
    for i in range(w):
      seq = h + window[b, 0, 1:i + 1].tolist() + window[b, 1:, i].tolist()
      assert int(top[b, i]) == _greedy_after(params, seq), (b, i)


# --- speculative generation -----------------------------------------------------


def test_greedy_equals_autoregressive_on_ragged_batch(params):
  ref = ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW)
  res = speculative.generate(params, CFG, DRAFTER, PROMPTS, max_new_tokens=NEW)
  assert res.tokens == ref.tokens
  assert not res.lossy


def test_sampled_runs_are_deterministic_given_the_seed(params):
  spec = speculative.SpecConfig(sampling=sampling_lib.SamplingConfig(temperature=1.0))
  run = lambda key: speculative.generate(params, CFG, DRAFTER, PROMPTS, key=key, spec=spec,
                                         max_new_tokens=NEW).tokens
  a = run(3)
  assert run(3) == a
  assert run(4) != a
  assert all(len(t) == NEW or t[-1] == CFG.eos_id for t in a)


def test_repeated_pattern_is_accepted(periodic):
  prompts = [[3, 4, 5, 6, 7, 3, 4], [6, 7, 3, 4, 5], [4, 5, 6, 7, 3, 4, 5]]
  ref = ar.generate(periodic, CFG, prompts, max_new_tokens=NEW)
  assert ref.tokens == [follow(p, NEW) for p in prompts]  # the target is periodic
  res = speculative.generate(periodic, CFG, DRAFTER, prompts, max_new_tokens=NEW)
  assert res.tokens == ref.tokens
  assert res.alpha > 0.9 and res.tau > 2.5, res.stats


def test_jacobi_window_alone_finds_the_continuation(periodic):
  """The prompts hold no n-gram of the output and the output does not repeat
  within NEW tokens: a second guess is only ever right through the n-grams
  the Jacobi window produced."""
  prompts = [[12, 22, 32, 17, 27, 37, 10], [25, 15, 35, 20], [30, 11, 21, 31, 13]]
  res = speculative.generate(periodic, CFG, DRAFTER, prompts, max_new_tokens=NEW)
  assert res.tokens == [follow(p, NEW) for p in prompts]
  assert sum(res.stats["accept_hist"][2:]) > 0, res.stats



# --- G candidates at once: the trie through the tree verifier -------------------

TREE_DRAFTER = la.LookaheadTree(k=2, window=4, ngram=3, max_candidates=4, pool_size=32)


def test_candidates_merge_into_a_trie():
  from specjax.trees import candidates_tree  # pylint: disable=import-outside-toplevel
  cands = jnp.asarray([[[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7], [5, 6, 7]]])
  lengths = jnp.asarray([[3, 3, 2, 3, 0]])
  tokens, parent = candidates_tree(cands, lengths)
  g = 5
  node = lambda c, i: i * g + c  # pylint: disable=unnecessary-lambda-assignment
  want = -2 * np.ones(15, np.int64)
  want[node(0, 0)] = want[node(3, 0)] = -1  # roots: 5 (shared by 0, 1, 2) and 4
  want[node(0, 1)] = want[node(2, 1)] = node(0, 0)  # 5 -> 6 (0, 1) and 5 -> 9 (2)
  want[node(3, 1)] = node(3, 0)
  want[node(0, 2)] = want[node(1, 2)] = node(0, 1)  # 5 6 -> 7 and 8
  want[node(3, 2)] = node(3, 1)  # candidate 2 has length 2; candidate 4 is empty
  np.testing.assert_array_equal(np.asarray(parent[0]), want)
  np.testing.assert_array_equal(np.asarray(tokens[0]), np.asarray(cands[0]).T.reshape(-1))


def test_tree_of_candidates_greedy_equals_autoregressive(params, periodic):
  ref = ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW)
  res = speculative.generate(params, CFG, TREE_DRAFTER, PROMPTS, max_new_tokens=NEW)
  assert res.tokens == ref.tokens and not res.lossy
  prompts = [[3, 4, 5, 6, 7, 3, 4], [6, 7, 3, 4, 5], [4, 5, 6, 7, 3, 4, 5]]
  chain = speculative.generate(periodic, CFG, DRAFTER, prompts, max_new_tokens=NEW)
  tree = speculative.generate(periodic, CFG, TREE_DRAFTER, prompts, max_new_tokens=NEW)
  assert tree.tokens == [follow(p, NEW) for p in prompts]
  assert tree.tau >= chain.tau > 2.5, (tree.stats, chain.stats)


def test_tree_of_candidates_sampled_is_reproducible(params):
  spec = speculative.SpecConfig(sampling=sampling_lib.SamplingConfig(temperature=1.0))
  run = lambda key: speculative.generate(params, CFG, TREE_DRAFTER, PROMPTS, key=key, spec=spec,  # pylint: disable=unnecessary-lambda-assignment
                                         max_new_tokens=NEW).tokens
  a = run(3)
  assert run(3) == a and run(4) != a
  with pytest.raises(ValueError, match="depth"):
    la.LookaheadTree(k=5, ngram=3)
