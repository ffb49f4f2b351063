"""The theory of speculative decoding's speed, defined once.

Leviathan et al. 2023 (arXiv:2211.17192), Section 3: with i.i.d. acceptance
rate alpha and k guesses per round,

  E[tokens per round] = (1 - alpha^(k+1)) / (1 - alpha)                (Eq. 1)

and, if a draft step costs c target steps and a verify forward costs one
target step, the walltime improvement factor is

  (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))                (Theorem 3.8)

On a CPU a verify over k + 1 tokens is NOT one target step (DESIGN.md: 8
tokens cost ~2x one in f32), so specjax's prediction replaces the theorem's
denominator with measured costs: the accepted-length histogram gives
E[tokens per round], and

  predicted speedup = E[tokens] * t_AR / (t_draft(k) + t_verify(k + 1)).

Both are reported side by side.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, Tuple

import numpy as np


def expected_tokens(alpha, k: int):
  """Eq. 1: expected tokens per round (bonus included) for i.i.d. acceptance alpha."""
  alpha = np.asarray(alpha, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    out = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
  return np.where(np.isclose(alpha, 1.0), k + 1.0, out)


def leviathan_speedup(alpha, k: int, c: float):
  """Theorem 3.8: walltime improvement assuming a verify costs one AR step."""
  return expected_tokens(alpha, k) / (k * c + 1.0)


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
  """The k maximising Theorem 3.8's improvement factor (Leviathan et al. Fig. 3)."""
  ks = np.arange(1, k_max + 1)
  return int(ks[np.argmax([leviathan_speedup(alpha, int(k), c) for k in ks])])


def interpolate_cost(costs: Mapping[int, float]) -> Callable[[float], float]:
  """A verify-cost curve t(n) from measured points {n_tokens: seconds}, linear in n."""
  ns = np.array(sorted(costs), np.float64)
  ts = np.array([costs[int(n)] for n in ns], np.float64)
  return lambda n: float(np.interp(n, ns, ts))


def predicted_speedup(tokens_per_round: float, t_ar: float, t_draft: float,
                      t_verify: float) -> float:
  """Calibrated prediction: E[tokens] per (draft + verify) time, against AR's per-token time."""
  return tokens_per_round * t_ar / (t_draft + t_verify)


def chain_tokens_from_histogram(accept_hist: Sequence[int], k: int) -> float:
  """Expected tokens per round had the chain been cut to its first k guesses
  (bonus included): 1 + sum_{m<=k} P(accepted >= m), from counts of rounds by
  accepted length of a longer chain. A chain's first k guesses do not depend
  on how many more follow, so this is exact for chain drafters whose rounds
  all proposed the full chain."""
  h = np.asarray(accept_hist, np.float64)
  if h.sum() <= 0:
    return float("nan")
  tail = h[::-1].cumsum()[::-1] / h.sum()  # tail[m] = P(accepted >= m)
  return float(1 + tail[1:k + 1].sum())


def greedy_rounds(correct) -> Tuple[int, int]:
  """Tokens and rounds of greedy k-chain decoding along one sequence, from its
  teacher-forced agreement: `correct` (n, k), row i the chain started at the
  sequence's i-th position (every start where a whole chain fits, in order),
  column s whether its (s + 1)-th guess equals the target's greedy token.

  Decoding does not start a chain at every position: a round accepts the
  leading run of n correct guesses, emits n + 1 tokens (the bonus or the
  correction included) and the next round starts right after them. tokens /
  rounds is the tau a greedy benchmark measures on that text; the mean over
  every start (`1 + mean cumprod sum`) weights long easy stretches, which
  decoding crosses in few rounds, as much as hard ones, where it spends many.
  Exact for greedy decoding of text that is the target's own greedy output
  (self-distilled greedy answers), whose prefixes teacher forcing reproduces."""
  c = np.asarray(correct, bool)
  if c.ndim != 2:
    raise ValueError(f"correct must be (starts, k), got shape {c.shape}")
  run = np.cumprod(c, axis=1).sum(1)
  i = tokens = rounds = 0
  while i < len(run):
    tokens += int(run[i]) + 1
    rounds += 1
    i += int(run[i]) + 1
  return tokens, rounds


def best_chain_length(accept_hist: Sequence[int], k_run: int, t_verify: Mapping[int, float],
                      t_draft: float) -> Tuple[int, float, dict]:
  """The cost-optimal draft length k' <= k_run for a chain drafter measured at
  k_run: argmax over k' of E[tokens](k') * t_verify(1) / (t_draft * k'/k_run +
  t_verify(k' + 1)) (drafting priced linear in the guesses drawn). Returns
  (k', its predicted speedup, {k': predicted speedup}). Widths missing from
  `t_verify` are interpolated linearly between the measured ones."""
  vals = {}
  if 1 not in t_verify or k_run + 1 not in t_verify:
    return k_run, float("nan"), {}
  cost = interpolate_cost(t_verify)
  for kk in range(1, k_run + 1):
    e = chain_tokens_from_histogram(accept_hist, kk)
    vals[kk] = e * t_verify[1] / (t_draft * kk / k_run + cost(kk + 1))
  if not vals:
    return k_run, float("nan"), {}
  best = max(vals, key=vals.get)
  return best, vals[best], vals


def best_tree_budget(node_values: Sequence[float], t_verify: Mapping[int, float],
                     t_draft: Callable[[int], float] | float,
                     budgets: Sequence[int] | None = None) -> Tuple[int, float, dict]:
  """The cost-optimal node budget of a tree built greedily from nodes of
  decreasing acceptance probability (`node_values[i]`: the probability that
  the i-th best node's whole path is accepted; Medusa's sparse tree, or
  EAGLE-2's reranked confidences): with N nodes a round emits
  1 + sum(node_values[:N]) tokens in expectation and costs t_draft(N) +
  t_verify(N + 1) (verify widths interpolated linearly between the measured
  ones). -> (N, its predicted speedup over AR, {N: predicted speedup}).
  This machine's verify-cost curve, not an A100's, decides how wide a tree
  pays."""
  if 1 not in t_verify:
    raise ValueError("t_verify needs the 1-token cost (the AR step)")
  cost = interpolate_cost(t_verify)
  widths = sorted(t_verify)
  top = max(widths) - 1
  cands = [n for n in (budgets or range(1, len(node_values) + 1))
           if 1 <= n <= min(len(node_values), top)]
  if not cands:
    raise ValueError(f"no budget within the measured verify widths (up to {top + 1})")
  draft = t_draft if callable(t_draft) else (lambda n: float(t_draft))
  csum = np.cumsum(np.asarray(node_values, np.float64))
  vals = {n: (1.0 + csum[n - 1]) * t_verify[1] / (draft(n) + cost(n + 1)) for n in cands}
  best = max(vals, key=vals.get)
  return best, vals[best], vals
