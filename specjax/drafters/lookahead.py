"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", arXiv:2402.02057), as a drafter.

No draft model and no training: the target itself runs Jacobi iterations over
a 2D window of future guesses and harvests the n-grams the iterations produce
into a pool; pool n-grams whose first token is the newest committed token are
proposed for verification.

The window (Sec. 3.1, Fig. 2). N-1 levels of W tokens. With `last` the newest
committed token at position n - 1 (not yet in the target's cache):

    level 0:  last   x_1    ...  x_{W-1}       positions n-1 .. n+W-2
    level l:  y_l,0  y_l,1  ...  y_l,W-1       positions n-1+l .. n+W-2+l

Column i is one Jacobi trajectory: the token at level l is at position
n - 1 + l + i, one past the level below it. One target forward feeds all
(N-1) * W tokens with the lookahead mask: the token at (level l, column i)
attends to the committed prefix, to level 0 columns 0..i, and to its own
column at levels 1..l -- a contiguous context of positions n-1 .. n-1+l+i.
The greedy output at the top level's column i extends that column to a full
n-gram (level 0, level 1, ..., level N-2, output), added to the pool keyed by
its first token. The window then moves one Jacobi step (the reference
implementation's ALWAYS_FWD_ONE): every level takes the level above it and the
outputs become the new top level; level 0 column 0 is refilled with the new
`last` each round, so column 0 always starts at the committed frontier.

Choosing the one proposal. The paper verifies up to G pool candidates keyed
by `last` in parallel. With one chain to verify, this drafter pre-verifies the
first token of its G best candidates (ranked by sightings, then recency, or by
recency alone: `select`) for free: level 0 column 0 of the lookahead forward
sees exactly the committed history, so its output is the target's greedy next
token. The first candidate that starts with it is proposed; if none does, that
token followed by the pool's best continuation of it. Under greedy
verification the first guess is then always accepted. `next_token=False`
proposes the best candidate as ranked, the pool lookup alone.

Differences from the paper, forced by the drafter interface:
- The paper runs the lookahead branch and the verification branch in ONE
  forward. Here verification is the loop's forward, so this drafter runs its
  own target forward per round: two target forwards per round, and `tau`
  (tokens per verify forward) overstates the speedup by that factor until the
  two branches are fused.
- `Lookahead` proposes a single candidate through the chain verifier (see
  above). `LookaheadTree` verifies the paper's G candidates at once: the
  pool's top G continuations of `last` (plus the pre-verified next token and
  its best continuation) merged into a trie (`tree.candidates_tree`) and
  verified by the tree verifier -- deterministic candidates, one-hot q, so
  exact for any sampling settings (`verify.tree_accept`, siblings in order).
- The pool is a fixed-capacity table of P n-grams per row with least-recently-
  used replacement (the paper: up to G n-grams per key, LRU per key). It is
  seeded from the prompt's n-grams and receives every committed n-gram (the
  reference implementation's POOL_FROM_PROMPT / append_new_generated_pool).

Exactness: the proposal is a deterministic function of what was committed
before the round (the window and pool are built from argmax outputs of the
target, never from the round's randomness) and its q is one-hot, so the chain
rule keeps the target's distribution for any sampling settings. The lookahead
forward writes the target's cache at slots length-1 .. length-2+(N-1)*W; the
verify forward rewrites length-1 .. length-1+K and everything above the
committed prefix is stale (never attended). Writes beyond the cache capacity
are dropped by the scatter: tokens there see less context and make worse
guesses, never wrong outputs. `block` is the capacity the loop should reserve
so that this never happens.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from specjax import trees
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import cut_at_eos, one_hot_q
from specjax.models import transformer

SELECT = ("recent", "frequent")
# Prompt n-grams seeded into a pool of P slots: the last SEED_SPAN * P of them
# (older ones would be evicted anyway; this bounds the O(M^2) dedup at init).
SEED_SPAN = 2


# --- the n-gram pool --------------------------------------------------------


@flax.struct.dataclass
class NgramPool:
  """Per row: up to P distinct n-grams, stored as first token + continuation."""

  first: Int[Array, "B P"]  # first token; -1 marks an empty slot
  cont: Int[Array, "B P N1"]  # the N-1 tokens that followed it
  stamp: Int[Array, "B P"]  # clock at the last insertion or sighting; -1 empty
  count: Int[Array, "B P"]  # sightings
  clock: Int[Array, "B"]  # advances by the number of n-grams offered


def empty_pool(batch: int, capacity: int, ngram: int) -> NgramPool:
  fill = jnp.full((batch, capacity), -1, jnp.int32)
  return NgramPool(first=fill, cont=jnp.zeros((batch, capacity, ngram - 1), jnp.int32),
                   stamp=fill, count=jnp.zeros((batch, capacity), jnp.int32),
                   clock=jnp.zeros((batch,), jnp.int32))


def pool_insert(pool: NgramPool, first: Int[Array, "B M"], cont: Int[Array, "B M N1"],
                valid: Bool[Array, "B M"]) -> NgramPool:
  """Offer M n-grams per row (later ones count as more recent).

  An n-gram already in the pool is not duplicated: its count grows and its
  stamp is refreshed. New distinct n-grams replace the least recently seen
  slots (empty slots first); if more than P are new, the last P win.
  """
  b, p = pool.first.shape
  m = first.shape[1]
  stamp_new = pool.clock[:, None] + jnp.arange(m, dtype=jnp.int32)[None]  # (B, M)
  twin = ((first[:, :, None] == first[:, None, :])
          & jnp.all(cont[:, :, None] == cont[:, None, :], axis=-1)
          & valid[:, :, None] & valid[:, None, :])  # (B, M, M)
  later = jnp.triu(jnp.ones((m, m), bool), 1)  # [j, j'] : j' > j
  superseded = jnp.any(twin & later, axis=2)  # the batch's last copy stands for it
  hits = ((first[:, :, None] == pool.first[:, None, :])
          & jnp.all(cont[:, :, None, :] == pool.cont[:, None, :, :], axis=-1)
          & valid[:, :, None])  # (B, M, P)
  stamp = jnp.maximum(pool.stamp, jnp.max(jnp.where(hits, stamp_new[:, :, None], -1), axis=1))
  count = pool.count + jnp.sum(hits, axis=1, dtype=jnp.int32)

  fresh = valid & ~superseded & ~jnp.any(hits, axis=2)
  keep = min(m, p)
  from_end = jnp.sum(fresh, axis=1, keepdims=True) - jnp.cumsum(fresh, axis=1)  # 0: newest
  _, victims = jax.lax.top_k(-stamp, keep)  # least recently seen first
  slot = jnp.take_along_axis(victims, jnp.minimum(from_end, keep - 1), axis=1)
  slot = jnp.where(fresh & (from_end < keep), slot, p)  # p: dropped by the scatter
  rows = jnp.arange(b)[:, None]
  return NgramPool(
      first=pool.first.at[rows, slot].set(first, mode="drop"),
      cont=pool.cont.at[rows, slot].set(cont, mode="drop"),
      stamp=stamp.at[rows, slot].set(stamp_new, mode="drop"),
      count=count.at[rows, slot].set(jnp.sum(twin, axis=2, dtype=jnp.int32), mode="drop"),
      clock=pool.clock + m)


def pool_lookup(pool: NgramPool, token: Int[Array, "B"], num: int, select: str = "recent"):
  """The best `num` continuations of n-grams starting with `token`, best first.

  select="recent": most recently seen first; "frequent": most often seen
  first, ties by recency. Returns (cont (B, num, N-1), found (B, num) bool).
  """
  if select not in SELECT:
    raise ValueError(f"select must be one of {SELECT}, got {select!r}")
  match = pool.first == token[:, None]
  sort_keys = (pool.stamp, match) if select == "recent" else (pool.stamp, pool.count, match)
  order = jnp.lexsort(sort_keys, axis=-1)[:, ::-1][:, :num]  # (B, num) best first
  found = jnp.take_along_axis(match, order, axis=1)
  return jnp.take_along_axis(pool.cont, order[:, :, None], axis=1), found


def ngrams_of(tokens: Int[Array, "B T"], starts: Int[Array, "B M"], ngram: int):
  """The n-grams tokens[b, s : s + ngram] -> (first (B, M), cont (B, M, N-1))."""
  idx = jnp.clip(starts[:, :, None] + jnp.arange(ngram)[None, None], 0, tokens.shape[1] - 1)
  grams = jnp.take_along_axis(tokens[:, None, :], idx, axis=2)  # (B, M, N)
  return grams[..., 0], grams[..., 1:]


# --- the drafter ------------------------------------------------------------


@flax.struct.dataclass
class LookaheadState:
  window: Int[Array, "B N1 W"]  # level 0 column 0 is overwritten with `last` each round
  steps: Int[Array, "B"]  # lookahead forwards run so far
  harvested: Int[Array, "B"]  # committed n-grams ending before this position are pooled
  pool: NgramPool


def lookahead_mask(ngram: int, window: int) -> np.ndarray:
  """(T, T) bool over the flattened window, T = (N-1) W, level-major.

  (l, i) sees (0, j) for j <= i and (l', i) for 1 <= l' <= l.
  """
  level, col = np.divmod(np.arange((ngram - 1) * window), window)
  lq, cq = level[:, None], col[:, None]
  lk, ck = level[None, :], col[None, :]
  return ((lk == 0) & (ck <= cq)) | ((lk >= 1) & (lk <= lq) & (ck == cq))


def jacobi_step(target, window: Int[Array, "B N1 W"], length: Int[Array, "B"], cache,
                active: Bool[Array, "B"]):
  """One lookahead forward of the target over the window (level 0 column 0
  being the newest committed token, at position length - 1).

  The cache holds `history[:length - 1]` (fill level length - 1, as the
  speculative loop keeps it). Returns (nxt (B,), top (B, W), cache): the
  target's greedy choice after the newest committed token (level 0 column 0
  sees exactly the committed history), the greedy outputs of the top level --
  top[:, i] continues column i -- and the cache with the window written above
  the committed prefix (fill level advanced by N1 x W on active rows; the
  loop's verify forward rewinds and rewrites it).
  """
  b, n1, w = window.shape
  level, col = np.divmod(np.arange(n1 * w), w)
  positions = (length - 1)[:, None] + jnp.asarray(level + col, jnp.int32)[None]
  _, hidden, cache = transformer.forward(
      target.params, target.cfg, window.reshape(b, -1), positions, cache,
      jnp.asarray(lookahead_mask(n1 + 1, w)), active=active, compute_logits=False)
  # Only these outputs are used: skip the LM head elsewhere.
  rows = jnp.concatenate([hidden[:, :1], hidden[:, -w:]], axis=1)
  out = jnp.argmax(transformer.lm_head(target.params, target.cfg, rows), axis=-1)
  out = out.astype(jnp.int32)
  return out[:, 0], out[:, 1:], cache


@dataclasses.dataclass(frozen=True)
class Lookahead(Drafter):
  """Lookahead decoding with window W, n-gram size N, G candidates, pool size P.

  `k` is N - 1 for the default N = 4 (one whole n-gram continuation; set it
  with N: a larger k only pads, a smaller one truncates the continuations).
  `select` ranks the pool's candidates: "recent" or "frequent" (see
  `pool_lookup`); `next_token` pre-verifies their first token (module
  docstring).
  """

  k: int = 3
  window: int = 8  # W
  ngram: int = 4  # N
  max_candidates: int = 8  # G
  pool_size: int = 128  # P
  select: str = "frequent"
  next_token: bool = True
  name = "lookahead"

  def __post_init__(self):
    for field in ("window", "ngram", "max_candidates", "pool_size"):
      if not isinstance(getattr(self, field), int):
        raise ValueError(f"{field} must be an integer, got {getattr(self, field)!r}")
    if self.window < 1:
      raise ValueError(f"window W must be >= 1, got {self.window}")
    if self.ngram < 2:
      raise ValueError(f"n-gram size N must be >= 2, got {self.ngram}")
    if not 1 <= self.max_candidates <= self.pool_size:
      raise ValueError(f"need 1 <= max_candidates G <= pool_size P, got G="
                       f"{self.max_candidates}, P={self.pool_size}")
    if self.select not in SELECT:
      raise ValueError(f"select must be one of {SELECT}, got {self.select!r}")
    super().__post_init__()

  @property
  def block(self) -> int:
    """Slots one round writes past the committed prefix: the loop should size
    the target cache for prompt + max_new_tokens + max(k + 1, block)."""
    return max(self.k + 1, (self.ngram - 1) * self.window)

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots):
    b, t = prompt_tokens.shape
    n, w = self.ngram, self.window
    # The first guesses: tokens of the prompt at positions drawn with a fixed
    # key (a heuristic; it must not consume the request's randomness).
    pick = jax.random.randint(jax.random.key(0), (b, n - 1, w), 0, prompt_lengths[:, None, None])
    window = jnp.take_along_axis(prompt_tokens[:, None, :], pick.reshape(b, 1, -1), axis=2)
    pool = empty_pool(b, self.pool_size, n)
    span = min(t - n + 1, SEED_SPAN * self.pool_size)
    if span > 0:  # the prompt's last `span` n-grams, oldest first
      starts = prompt_lengths[:, None] - n - (span - 1) + jnp.arange(span)[None]
      first, cont = ngrams_of(prompt_tokens, starts, n)
      pool = pool_insert(pool, first, cont, starts >= 0)
    return LookaheadState(window=window.reshape(b, n - 1, w).astype(jnp.int32),
                          steps=jnp.zeros((b,), jnp.int32),
                          harvested=prompt_lengths.astype(jnp.int32), pool=pool)

  def propose(self, params, target, state, ctx, target_cache, keys):
    """The round's Jacobi forward runs on the target and its cache (base's
    module docstring: drafters that write into the target's cache)."""
    cfg = target.cfg
    pool, last, nxt, state, cache = self._lookahead(target, state, ctx, target_cache)
    tokens, num = self.choose(pool, last, nxt)
    if self.k <= self.ngram - 1:
      tokens = tokens[:, :self.k]
    else:
      tokens = jnp.pad(tokens, ((0, 0), (0, self.k - (self.ngram - 1))),
                       constant_values=cfg.pad_id)
    num = jnp.where(ctx.active, jnp.minimum(num, self.k), 0).astype(jnp.int32)
    num = cut_at_eos(tokens, num, cfg.eos_id)
    proposal = Proposal(tokens=tokens, q=one_hot_q(tokens, cfg.vocab_size), num_proposed=num)
    return proposal, state, cache

  def _lookahead(self, target, state, ctx, target_cache):
    """The round's lookahead forward and pool update -> (pool, last, nxt, state, cache)."""
    b = ctx.length.shape[0]
    n, w = self.ngram, self.window
    last = jnp.take_along_axis(ctx.history, (ctx.length - 1)[:, None], axis=1)[:, 0]
    window = state.window.at[:, 0, 0].set(last)
    nxt, top, cache = jacobi_step(target, window, ctx.length, target_cache, ctx.active)
    stack = jnp.concatenate([window[:, 1:], top[:, None]], axis=1)
    # Column i's n-gram: level 0 .. N-2 and the output. Until N-2 forwards have
    # run, the upper levels still hold the initial (non-Jacobi) tokens.
    harvest = ctx.active & (state.steps >= n - 2)
    pool = pool_insert(state.pool, window[:, 0], jnp.swapaxes(stack, 1, 2),
                       jnp.broadcast_to(harvest[:, None], (b, w)))
    act = ctx.active[:, None, None]
    state = state.replace(window=jnp.where(act, stack, state.window),
                          steps=state.steps + ctx.active.astype(jnp.int32), pool=pool)
    return pool, last, nxt, state, cache

  def choose(self, pool: NgramPool, last: Int[Array, "B"], nxt: Int[Array, "B"]):
    """The single proposal for rows whose newest committed token is `last` and
    whose target's greedy next token is `nxt`: (tokens (B, N-1), num (B,))."""
    n = self.ngram
    cont, found = pool_lookup(pool, last, self.max_candidates, self.select)
    if not self.next_token:
      return cont[:, 0], jnp.where(found[:, 0], n - 1, 0)
    agree = found & (cont[:, :, 0] == nxt[:, None])
    pick = jnp.take_along_axis(cont, jnp.argmax(agree, axis=1)[:, None, None], axis=1)[:, 0]
    # No candidate agrees: nxt, then the best continuation of nxt (if any).
    cont2, found2 = pool_lookup(pool, nxt, 1, self.select)
    fallback = jnp.concatenate([nxt[:, None], cont2[:, 0, :n - 2]], axis=1)
    has = jnp.any(agree, axis=1)
    tokens = jnp.where(has[:, None], pick, fallback)
    num = jnp.where(has | found2[:, 0], n - 1, 1)
    return tokens, num

  def commit(self, params, state, ctx, verify):
    """Pool the n-grams that end at the newly committed tokens (at most k + 2
    per round: the prefill's first token, then the accepted guesses + one)."""
    n = self.ngram
    ends = state.harvested[:, None] + jnp.arange(self.k + 2, dtype=jnp.int32)[None]
    valid = ctx.active[:, None] & (ends < ctx.length[:, None]) & (ends >= n - 1)
    first, cont = ngrams_of(ctx.history, ends - (n - 1), n)
    pool = pool_insert(state.pool, first, cont, valid)
    harvested = jnp.where(ctx.active, ctx.length, state.harvested)
    return state.replace(pool=pool, harvested=harvested)


@dataclasses.dataclass(frozen=True)
class LookaheadTree(Lookahead):
  """Lookahead decoding verifying its G candidates at once, as the paper does:
  the pool's best `max_candidates` continuations of the newest committed
  token, then (with `next_token`) the target's greedy next token followed by
  the pool's best continuation of it, merged into a trie of depth N - 1 and
  verified in the loop's one tree forward. `k` is the trie's depth: N - 1.
  """

  tree = True
  name = "lookahead_tree"

  def __post_init__(self):
    super().__post_init__()
    if self.k != self.ngram - 1:
      raise ValueError(f"{self.name}: k is the trie's depth N - 1 = {self.ngram - 1}, "
                       f"got {self.k}")

  @property
  def num_candidates(self) -> int:
    return self.max_candidates + int(self.next_token)

  @property
  def num_nodes(self) -> int:
    return self.num_candidates * (self.ngram - 1)

  @property
  def block(self) -> int:
    return max(self.num_nodes + 1, (self.ngram - 1) * self.window)

  def propose(self, params, target, state, ctx, target_cache, keys):
    cfg = target.cfg
    n = self.ngram
    pool, last, nxt, state, cache = self._lookahead(target, state, ctx, target_cache)
    cont, found = pool_lookup(pool, last, self.max_candidates, self.select)  # (B, G, N-1)
    lengths = jnp.where(found, n - 1, 0)
    if self.next_token:
      cont2, found2 = pool_lookup(pool, nxt, 1, self.select)
      fallback = jnp.concatenate([nxt[:, None], cont2[:, 0, :n - 2]], axis=1)
      cont = jnp.concatenate([cont, fallback[:, None]], axis=1)
      lengths = jnp.concatenate([lengths, jnp.where(found2[:, :1], n - 1, 1)], axis=1)
    # a drafted EOS ends its candidate
    is_eos = cont == cfg.eos_id
    first_eos = jnp.where(jnp.any(is_eos, -1), jnp.argmax(is_eos, -1) + 1, n - 1)
    lengths = jnp.where(ctx.active[:, None], jnp.minimum(lengths, first_eos), 0)
    tokens, parent = trees.candidates_tree(cont, lengths.astype(jnp.int32))
    num = jnp.where(ctx.active, self.num_nodes, 0).astype(jnp.int32)
    return (Proposal(tokens=tokens, q=one_hot_q(tokens, cfg.vocab_size), num_proposed=num,
                     parent=parent), state, cache)
