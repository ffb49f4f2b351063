"""Acceptance rules: which drafted tokens the target keeps, and what comes next.

Every rule takes K guesses per row, the target's distributions at the K
guessed positions plus one more (the "bonus" position after the last guess),
and returns `(num_accepted, next_token)`: the row keeps its first
`num_accepted` guesses and then appends `next_token`, so each call emits
`num_accepted + 1` tokens. Rows are independent and ragged: row b proposed
only its first `num_proposed[b]` guesses; later slots are padding and never
accepted.

Rules:

* `chain_accept` -- speculative sampling (Leviathan et al. 2023,
  arXiv:2211.17192, Algorithm 1 and Section 2.3; Chen et al. 2023,
  arXiv:2302.01318, Algorithm 2 and Theorem 1). Exact: the emitted tokens are
  distributed as if sampled from the target one at a time.
* `greedy_accept` -- its temperature-0 limit: keep guesses equal to the
  target's argmax. Exact for greedy decoding.
* `typical_accept` -- Medusa's typical acceptance (Cai et al. 2024,
  arXiv:2401.10774, Section 2.3.1). LOSSY: the output distribution is not the
  target's. Listed in `LOSSY_RULES` so callers can label what they report.

Shapes: B rows, K guesses, V vocabulary. K and V are static (taken from the
array shapes), everything else may be traced. This module imports no model
code: the rules see only token ids and probabilities, which is what lets the
tests feed them hand-made distributions.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from specjax import sampling

# Names of the rules whose output distribution differs from the target's.
LOSSY_RULES = frozenset({"typical"})

# fold_in constants naming the purpose of each key derived from a row's key:
# the K acceptance uniforms and the one draw of the next token (residual or
# bonus, never both) come from different streams, so no randomness is reused.
ACCEPT_STREAM = 0
DRAW_STREAM = 1

# A residual max(0, p - q) with at most this much mass is treated as empty and
# the next token is drawn from p instead. For normalised p and q the chance of
# rejecting at a position, sum_x max(0, q(x) - p(x)), equals the residual's
# mass, so whatever is drawn from a residual of mass m moves the output law
# by at most m in total variation: below the floor any choice is exact to
# 1e-12. The floor only keeps the draw well defined when the residual is
# (numerically) all zeros: p == q up to round-off (normalisation errors of
# ~1e-7 can still cause a rejection) or a guess with q(x) = p(x) = 0.
RESIDUAL_MASS_FLOOR = 1e-12


def accepted_mask(num_accepted: Int[Array, "B"], K: int) -> Bool[Array, "B K"]:
  """(B, K) mask of the kept guesses: slot i of row b is kept iff i < num_accepted[b]."""
  return jnp.arange(K)[None, :] < num_accepted[:, None]


def _leading_true(ok: Bool[Array, "B K"]) -> Int[Array, "B"]:
  """Length of the run of True at the start of each row."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _proposed(num_proposed: Int[Array, "B"], K: int) -> Int[Array, "B"]:
  # Out-of-range counts cannot be reported from inside jit; clamping keeps the
  # result a valid draw instead of indexing past the K guesses.
  return jnp.clip(jnp.asarray(num_proposed, jnp.int32), 0, K)


def _check_shapes(draft_tokens, dists, extra: int, name: str) -> Tuple[int, int, int]:
  B, K = draft_tokens.shape
  if dists.ndim != 3 or dists.shape[:2] != (B, K + extra):
    raise ValueError(
        f"{name} must have shape (B, K+{extra}, V) = ({B}, {K + extra}, V) for "
        f"draft_tokens of shape {draft_tokens.shape}, got {dists.shape}")
  return B, K, dists.shape[-1]


def chain_accept_with_uniforms(
    u_accept: Float[Array, "B K"],
    u_draw: Float[Array, "B"],
    draft_tokens: Int[Array, "B K"],
    q: Float[Array, "B K V"],
    p: Float[Array, "B K+1 V"],
    num_proposed: Int[Array, "B"],
) -> Tuple[Int[Array, "B"], Int[Array, "B"]]:
  """Speculative sampling (Leviathan et al. 2023, Algorithm 1) with given uniforms.

  For each row, guess x_i was drawn from q_i and the target's distribution at
  that position is p_i. Scanning i = 0, 1, ..., the guess is kept iff

      u_i * q_i(x_i) < p_i(x_i)                                          (1)

  i.e. with probability min(1, p_i(x_i) / q_i(x_i)) (Section 2.3), written
  without a division so q_i(x_i) = 0 needs no special case. The comparison is
  strict because float32 uniforms can be exactly 0: with `<=` a guess the
  target gives probability 0 would be kept. Let n be the number of leading
  kept guesses among the first `num_proposed`. Then

    * n < num_proposed (guess n rejected): the next token is drawn from the
      residual p'(x) = norm(max(0, p_n(x) - q_n(x))) over the whole
      vocabulary (Algorithm 1's "adjust the distribution"; Chen et al. 2023,
      Algorithm 2, with their p and q swapped: there q is the target);
    * n == num_proposed (every proposal kept, including num_proposed == 0):
      the next token is drawn from p_n, the bonus.

  Keeping x with probability min(p, q)(x) and otherwise drawing from the
  residual, whose total probability is 1 - sum_x min(p, q)(x), gives
  min(p, q)(x) + max(0, p - q)(x) = p(x) (Leviathan et al., Appendix A.1;
  Chen et al., Theorem 1): the rule is exact for any q, including q with
  zeros where p is positive.

  Deterministic drafters (n-gram lookup, greedy drafts) need no separate rule:
  their q_i is one-hot at x_i, so (1) keeps x_i with probability p_i(x_i),
  and the residual max(0, p_i - onehot(x_i)) is p_i with x_i removed, which
  normalised is p_i(. | not x_i) -- the textbook rule for a point proposal.

  Draws use `specjax.sampling.inverse_cdf`, the function behind
  `sampling.sample_from_probs`, with the uniform `u_draw`: the unnormalised
  residual is drawn from directly (inverse_cdf scales u by the row total).
  Uniforms beyond a row's first rejection are read but cannot change the
  result, which is why all K tests can be evaluated at once.

  Args:
    u_accept: (B, K) uniforms in [0, 1) for test (1).
    u_draw: (B,) uniforms in [0, 1) for the residual or bonus draw.
    draft_tokens: (B, K) int guesses; slots >= num_proposed are ignored.
    q: (B, K, V) the exact distributions the guesses were drawn from.
    p: (B, K+1, V) the target's processed distributions (`sampling.probs`)
      at the K guessed positions and the bonus position.
    num_proposed: (B,) int in [0, K], guesses actually proposed per row.

  Returns:
    num_accepted: (B,) int32 in [0, num_proposed].
    next_token: (B,) int32, the token emitted after the kept guesses.
  """
  _, K, _ = _check_shapes(draft_tokens, p, 1, "p")
  if q.shape != p.shape[:1] + (K,) + p.shape[2:]:
    raise ValueError(f"q must have shape {p.shape[:1] + (K,) + p.shape[2:]}, got {q.shape}")
  num_proposed = _proposed(num_proposed, K)
  tokens = draft_tokens.astype(jnp.int32)[..., None]
  q_x = jnp.take_along_axis(q, tokens, axis=-1)[..., 0]
  p_x = jnp.take_along_axis(p[:, :K], tokens, axis=-1)[..., 0]
  keep = (u_accept * q_x < p_x) & (jnp.arange(K)[None, :] < num_proposed[:, None])
  n = _leading_true(keep)

  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  # When n == K there is no q_K; the clipped index is harmless because then
  # n == num_proposed and the residual is not used.
  q_n = jnp.take_along_axis(q, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  use_residual = (n < num_proposed) & (jnp.sum(residual, axis=-1) > RESIDUAL_MASS_FLOOR)
  dist = jnp.where(use_residual[:, None], residual, p_n)
  return n, sampling.inverse_cdf(dist, u_draw)


def chain_uniforms(keys: Key[Array, "B"], K: int) -> Tuple[Float[Array, "B K"], Float[Array, "B"]]:
  """The uniforms `chain_accept` uses: per row, K from the ACCEPT_STREAM key
  and one from the DRAW_STREAM key, drawn exactly as
  `sampling.sample_from_probs(fold_in(key, DRAW_STREAM), dist)` would."""
  def row(key):
    u_accept = jax.random.uniform(jax.random.fold_in(key, ACCEPT_STREAM), (K,), jnp.float32)
    u_draw = jax.random.uniform(jax.random.fold_in(key, DRAW_STREAM), (1,), jnp.float32)
    return u_accept, u_draw[0]
  return jax.vmap(row)(keys)


def chain_accept(
    keys: Key[Array, "B"],
    draft_tokens: Int[Array, "B K"],
    q: Float[Array, "B K V"],
    p: Float[Array, "B K+1 V"],
    num_proposed: Int[Array, "B"],
) -> Tuple[Int[Array, "B"], Int[Array, "B"]]:
  """Speculative sampling (Leviathan et al. 2023, Algorithm 1), exact.

  `keys` holds one typed PRNG key per row (`jax.random.key`); each row's key
  is split by purpose with `fold_in` (ACCEPT_STREAM, DRAW_STREAM), so a row's
  result depends on its own key only and is reproducible row by row. The next
  token equals `sampling.sample_from_probs(fold_in(key, DRAW_STREAM), dist)`
  for the residual or bonus `dist`. See `chain_accept_with_uniforms` for the
  rule, the arguments and the proof sketch.
  """
  u_accept, u_draw = chain_uniforms(keys, draft_tokens.shape[1])
  return chain_accept_with_uniforms(u_accept, u_draw, draft_tokens, q, p, num_proposed)


def greedy_accept(
    draft_tokens: Int[Array, "B K"],
    target_logits: Float[Array, "B K+1 V"],
    num_proposed: Int[Array, "B"],
) -> Tuple[Int[Array, "B"], Int[Array, "B"]]:
  """Greedy verification: the temperature-0 limit of `chain_accept`.

  With p_i one-hot at t_i = argmax(target_logits_i) (first index on ties, as
  `sampling.probs` does for temperature 0), test (1) keeps x_i iff x_i == t_i
  and both residual and bonus are one-hot at t_n. So: keep guesses while they
  equal the target's argmax; the next token is the argmax at the first
  mismatch (or at the bonus position). Deterministic, no RNG.
  """
  _, K, _ = _check_shapes(draft_tokens, target_logits, 1, "target_logits")
  num_proposed = _proposed(num_proposed, K)
  target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
  keep = (draft_tokens == target[:, :K]) & (jnp.arange(K)[None, :] < num_proposed[:, None])
  n = _leading_true(keep)
  return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def typical_accept(
    draft_tokens: Int[Array, "B K"],
    p: Float[Array, "B K+1 V"],
    num_proposed: Int[Array, "B"],
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Tuple[Int[Array, "B"], Int[Array, "B"]]:
  """Typical acceptance (Cai et al. 2024, Medusa, Section 2.3.1). LOSSY.

  Keeps guesses while

      p_i(x_i) > min(epsilon, delta * exp(-H(p_i)))

  with H the entropy of the target's distribution at that position, and then
  emits the argmax of p_n, as Medusa does. The output distribution is NOT the
  target's (e.g. a rejection always yields the mode, and any guess above the
  threshold is kept whatever q was): use it only where lossy outputs are
  acceptable, and label results with `LOSSY_RULES`. Defaults are Medusa's
  (posterior_threshold 0.09, posterior_alpha 0.3 = sqrt(0.09)).
  """
  _, K, _ = _check_shapes(draft_tokens, p, 1, "p")
  num_proposed = _proposed(num_proposed, K)
  p_x = jnp.take_along_axis(p[:, :K], draft_tokens.astype(jnp.int32)[..., None], axis=-1)[..., 0]
  # entr(p) = -p log p with entr(0) = 0, so truncated (top-k/top-p) zeros are fine.
  entropy = jnp.sum(jax.scipy.special.entr(p[:, :K]), axis=-1)
  threshold = jnp.minimum(epsilon, delta * jnp.exp(-entropy))
  keep = (p_x > threshold) & (jnp.arange(K)[None, :] < num_proposed[:, None])
  n = _leading_true(keep)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  return n, jnp.argmax(p_n, axis=-1).astype(jnp.int32)


# ---- trees and multiple drafts -------------------------------------------------
#
# A candidate tree per row: N nodes in topological order (every node after its
# parent), node j holding the token tokens[j], its parent parent[j] (-1: the
# root, i.e. the newest committed token), and q[j], the distribution x_j was
# drawn from GIVEN everything drawn before it. Siblings appear in the order
# they were drawn. The target's forward over [root, node 0, ..., node N-1]
# (ancestor-only attention) gives p[0] at the root and p[j + 1] at node j: the
# distribution of the children of that position.
#
# One rule serves every way of drawing siblings, because what differs is only
# which q each sibling was drawn from:
#   * i.i.d. siblings from the drafter's q at the parent (SpecInfer, Miao et al.
#     2023, arXiv:2305.09781): q[j] = that q for every sibling;
#   * siblings without replacement (sequential sampling / Gumbel-top-k; Jeon et
#     al. 2024, arXiv:2402.14160): q[j] = the parent's q with the earlier
#     siblings' tokens zeroed and renormalised;
#   * deterministic candidates (n-gram lookup, Lookahead's pool, fixed top-k
#     of a drafter): q[j] = one-hot(x_j).
# Starting at the root with p_cur = p[0], the children of the current node are
# tested in order: x_j is kept iff u_j * q[j](x_j) < p_cur(x_j); kept -> move to
# node j, p_cur = p[j + 1]; rejected -> p_cur = norm(max(0, p_cur - q[j])) and
# the next sibling is tested. After the last child (or at a leaf) the next
# token is drawn from p_cur. Each test is one speculative-sampling step of a
# single draft against p_cur, whose output (kept token, else a draw from the
# residual) is distributed as p_cur; a rejected step hands the residual on as
# the distribution the next sibling is tested against -- so by induction over
# the siblings, and then over the depth, the emitted tokens are distributed as
# the target's. The precondition is what makes each step exact: x_j must be
# distributed as q[j] given everything before it (the earlier siblings and the
# path's acceptance decisions), so the tree's SHAPE below a node may depend on
# what was drawn at or above it, but a node's children may not be selected by
# their own values (an exact dynamic tree keeps a prefix of each node's draw
# order whose length is fixed before the children are drawn).


def _tree_shapes(tokens, parent, dists, extra: int, name: str):
  B, N = tokens.shape
  if parent.shape != (B, N):
    raise ValueError(f"parent must have shape {(B, N)} like tokens, got {parent.shape}")
  if dists.ndim != 3 or dists.shape[:2] != (B, N + extra):
    raise ValueError(f"{name} must have shape (B, N+{extra}, V) = ({B}, {N + extra}, V) for "
                     f"tokens of shape {tokens.shape}, got {dists.shape}")
  return B, N, dists.shape[-1]


def tree_accept_with_uniforms(
    u_accept: Float[Array, "B N"],
    u_draw: Float[Array, "B"],
    tokens: Int[Array, "B N"],
    parent: Int[Array, "B N"],
    q: Float[Array, "B N V"],
    p: Float[Array, "B N+1 V"],
    num_nodes: Int[Array, "B"],
) -> Tuple[Int[Array, "B N"], Int[Array, "B"], Int[Array, "B"]]:
  """Exact multi-draft / tree verification (see the comment above) with given uniforms.

  Returns:
    path: (B, N) int32, the accepted nodes from the root down (entries at or
      beyond num_accepted are -1).
    num_accepted: (B,) int32, the accepted path's length.
    next_token: (B,) int32, drawn from the final p_cur.
  """
  B, N, _ = _tree_shapes(tokens, parent, p, 1, "p")
  if q.shape != (B, N) + p.shape[2:]:
    raise ValueError(f"q must have shape {(B, N) + p.shape[2:]}, got {q.shape}")
  num_nodes = jnp.clip(jnp.asarray(num_nodes, jnp.int32), 0, N)
  tokens = tokens.astype(jnp.int32)
  rows = jnp.arange(B)

  def step(carry, j):
    cur, p_cur, n, path = carry
    x = tokens[:, j]
    q_j = q[:, j]
    child = (parent[:, j] == cur) & (j < num_nodes)
    q_x = q_j[rows, x]
    p_x = p_cur[rows, x]
    keep = child & (u_accept[:, j] * q_x < p_x)
    reject = child & ~keep
    residual = jnp.maximum(p_cur - q_j, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # An (numerically) empty residual means p_cur <= q_j: rejection had
    # probability ~0 (its mass), and p_cur is kept as it is.
    residual = jnp.where(mass > RESIDUAL_MASS_FLOOR, residual / jnp.maximum(mass, 1e-30), p_cur)
    p_cur = jnp.where(keep[:, None], p[:, j + 1], jnp.where(reject[:, None], residual, p_cur))
    path = path.at[rows, jnp.where(keep, n, N)].set(j, mode="drop")
    return (jnp.where(keep, j, cur), p_cur, n + keep.astype(jnp.int32), path), None

  init = (jnp.full((B,), -1, jnp.int32), p[:, 0], jnp.zeros((B,), jnp.int32),
          jnp.full((B, N), -1, jnp.int32))
  (_, p_cur, n, path), _ = jax.lax.scan(step, init, jnp.arange(N))
  return path, n, sampling.inverse_cdf(p_cur, u_draw)


def tree_uniforms(keys: Key[Array, "B"], N: int) -> Tuple[Float[Array, "B N"], Float[Array, "B"]]:
  """One acceptance uniform per node and one draw uniform per row (the streams
  of `chain_uniforms`)."""
  return chain_uniforms(keys, N)


def tree_accept(keys: Key[Array, "B"], tokens, parent, q, p, num_nodes):
  """`tree_accept_with_uniforms` with the uniforms of each row's key."""
  u_accept, u_draw = tree_uniforms(keys, tokens.shape[1])
  return tree_accept_with_uniforms(u_accept, u_draw, tokens, parent, q, p, num_nodes)


def tree_greedy_accept(
    tokens: Int[Array, "B N"],
    parent: Int[Array, "B N"],
    target_logits: Float[Array, "B N+1 V"],
    num_nodes: Int[Array, "B"],
) -> Tuple[Int[Array, "B N"], Int[Array, "B"], Int[Array, "B"]]:
  """Greedy tree verification: from the root, move to the child whose token is
  the target's argmax there (the first such child in node order), until none
  is; the next token is the argmax at the last accepted node. The
  temperature-0 limit of `tree_accept`. -> (path, num_accepted, next_token)."""
  B, N, _ = _tree_shapes(tokens, parent, target_logits, 1, "target_logits")
  num_nodes = jnp.clip(jnp.asarray(num_nodes, jnp.int32), 0, N)
  best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # (B, N + 1)
  rows = jnp.arange(B)
  tokens = tokens.astype(jnp.int32)

  def step(carry, j):
    cur, n, path = carry
    keep = (parent[:, j] == cur) & (j < num_nodes) & (tokens[:, j] == best[rows, cur + 1])
    path = path.at[rows, jnp.where(keep, n, N)].set(j, mode="drop")
    return (jnp.where(keep, j, cur), n + keep.astype(jnp.int32), path), None

  init = (jnp.full((B,), -1, jnp.int32), jnp.zeros((B,), jnp.int32),
          jnp.full((B, N), -1, jnp.int32))
  (cur, n, path), _ = jax.lax.scan(step, init, jnp.arange(N))
  return path, n, best[rows, cur + 1]


def without_replacement(q_parent: Float[Array, "... V"], tokens: Int[Array, "... M"]
                        ) -> Float[Array, "... M V"]:
  """The q of each of M siblings drawn in order WITHOUT replacement from
  q_parent: sibling i's distribution is q_parent with siblings 0..i-1 zeroed
  and renormalised (zeros where nothing is left)."""
  m = tokens.shape[-1]
  v = q_parent.shape[-1]
  seen = jax.nn.one_hot(tokens, v, dtype=q_parent.dtype)  # (..., M, V)
  before = jnp.cumsum(seen, axis=-2) - seen  # siblings strictly before i
  qi = q_parent[..., None, :] * (before == 0)
  total = jnp.sum(qi, axis=-1, keepdims=True)
  del m
  return jnp.where(total > 0, qi / jnp.maximum(total, 1e-30), 0.0)
