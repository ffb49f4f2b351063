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
