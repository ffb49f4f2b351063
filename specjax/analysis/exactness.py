"""Tools to check that a decoding method samples from the target distribution.

Three kinds of evidence, strongest first:

1. Exact arithmetic (float64): `chain_output_distribution` computes the law of
   the token the speculative sampling rule emits, which must equal p;
   `joint_distribution_exact` enumerates the law of short sequences from a
   next-token function, the ground truth for end-to-end tests.
2. Differential testing: `reference_algorithm1` is a plain float64
   transcription of Leviathan et al. (2023) Algorithm 1 that consumes given
   uniforms, so `specjax.verify.chain_accept_with_uniforms` can be compared
   with it token for token.
3. Statistics on samples: chi-square goodness of fit with bin pooling, total
   variation with an explicit noise bound and detectable effect size,
   randomized PIT values with a Kolmogorov-Smirnov uniformity test, and Holm's
   step-down correction for many tests at once.

NumPy/SciPy only, float64 throughout: the references must not share float32
round-off (or code) with what they check.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, NamedTuple, Sequence, Tuple

import numpy as np
from scipy import stats

# Same meaning and value as specjax.verify.RESIDUAL_MASS_FLOOR; repeated, not
# imported, so that this reference does not depend on the code it checks.
RESIDUAL_MASS_FLOOR = 1e-12


def _as_distribution(x, name: str, atol: float = 1e-6) -> np.ndarray:
  x = np.asarray(x, dtype=np.float64)
  if np.any(x < 0) or not np.all(np.isfinite(x)):
    raise ValueError(f"{name} must be finite and non-negative")
  if not np.allclose(x.sum(axis=-1), 1.0, atol=atol):
    raise ValueError(f"{name} must sum to 1 over its last axis (atol {atol}), "
                     f"got sums {x.sum(axis=-1)}")
  return x


def chain_output_distribution(p, q) -> np.ndarray:
  """Exact law of the token emitted at one position of speculative sampling.

  A guess x ~ q is kept with probability min(1, p(x)/q(x)); otherwise a token
  is drawn from the residual norm(max(0, p - q)). The emitted token therefore
  has law

      min(p, q) + (sum(q) - sum(min(p, q))) * norm(max(0, p - q)),

  which equals p (Leviathan et al. 2023, Appendix A.1; Chen et al. 2023,
  Theorem 1). The rejection mass is computed as sum(q) - sum(min(p, q)) -- the
  q-mass of the rejected outcomes -- rather than assumed to equal the residual
  mass, so the result shows what the rule does with the inputs as given.
  An empty residual (p == q) falls back to p, as `specjax.verify` does.

  Args:
    p, q: (..., V) distributions (sums within 1e-6 of 1).

  Returns:
    (..., V) float64.
  """
  p = _as_distribution(p, "p")
  q = _as_distribution(q, "q")
  kept = np.minimum(p, q)
  residual = np.maximum(p - q, 0.0)
  mass = residual.sum(axis=-1, keepdims=True)
  empty = mass <= RESIDUAL_MASS_FLOOR
  residual = np.where(empty, p, residual / np.where(empty, 1.0, mass))
  reject = q.sum(axis=-1, keepdims=True) - kept.sum(axis=-1, keepdims=True)
  return kept + reject * residual


def reference_inverse_cdf(p, u: float) -> int:
  """Float64 transcription of `specjax.sampling.inverse_cdf` for one row.

  The number of CDF entries <= u * total, clipped to the last index with
  positive mass. Agrees with the float32 version except when u * total lies
  within round-off of a CDF entry.
  """
  p = np.asarray(p, dtype=np.float64)
  cdf = np.cumsum(p)
  idx = int(np.sum(cdf <= u * cdf[-1]))
  positive = np.flatnonzero(p > 0)
  last = int(positive[-1]) if positive.size else p.shape[-1] - 1
  return min(idx, last)


def reference_algorithm1(p_rows, q_rows, draft_tokens, uniforms, residual_uniform,
                         num_proposed=None) -> Tuple[int, int]:
  """Leviathan et al. (2023) Algorithm 1 for one row, fed given uniforms.

  A literal loop, for differential testing of
  `specjax.verify.chain_accept_with_uniforms`:

      for i in range(num_proposed):
        if uniforms[i] * q_i(x_i) < p_i(x_i): keep x_i        # r_i < p/q
        else: return i, draw(norm(max(0, p_i - q_i)))       # rejection
      return num_proposed, draw(p_num_proposed)              # bonus

  Draws use `reference_inverse_cdf` with `residual_uniform`; an empty residual
  (mass <= RESIDUAL_MASS_FLOOR) is replaced by p_i.

  Args:
    p_rows: (K+1, V) target distributions. q_rows: (K, V) draft distributions.
    draft_tokens: (K,) guesses. uniforms: (K,). residual_uniform: scalar.
    num_proposed: guesses proposed (default K).

  Returns:
    (num_accepted, next_token) as Python ints.
  """
  p_rows = np.asarray(p_rows, dtype=np.float64)
  q_rows = np.asarray(q_rows, dtype=np.float64)
  K = q_rows.shape[0]
  num_proposed = K if num_proposed is None else int(num_proposed)
  for i in range(num_proposed):
    x = int(draft_tokens[i])
    if float(uniforms[i]) * q_rows[i, x] < p_rows[i, x]:
      continue
    residual = np.maximum(p_rows[i] - q_rows[i], 0.0)
    if residual.sum() <= RESIDUAL_MASS_FLOOR:
      residual = p_rows[i]
    return i, reference_inverse_cdf(residual, float(residual_uniform))
  return num_proposed, reference_inverse_cdf(p_rows[num_proposed], float(residual_uniform))


def joint_distribution_exact(next_token_probs: Callable[[Tuple[int, ...]], Sequence[float]],
                             num_tokens: int, prefix: Tuple[int, ...] = ()) -> np.ndarray:
  """Exact joint law of the next `num_tokens` tokens of an autoregressive sampler.

  `next_token_probs(prefix)` returns the (V,) distribution of the token after
  the tuple `prefix`. Enumerates all V**num_tokens continuations (keep V and
  num_tokens small) and returns an array of shape (V,) * num_tokens whose
  entry [x_1, ..., x_m] is prod_t P(x_t | prefix, x_<t). Branches of zero
  probability are not expanded.
  """
  first = np.asarray(next_token_probs(tuple(prefix)), dtype=np.float64)
  V = first.shape[-1]
  joint = np.zeros((V,) * num_tokens, dtype=np.float64)
  for seq in itertools.product(range(V), repeat=num_tokens):
    prob, probs_t = 1.0, first
    for t, x in enumerate(seq):
      prob *= probs_t[x]
      if prob == 0.0:
        break
      if t + 1 < num_tokens:
        probs_t = np.asarray(next_token_probs(tuple(prefix) + seq[:t + 1]), dtype=np.float64)
    joint[seq] = prob
  return joint


def empirical_distribution(samples, num_categories: int) -> np.ndarray:
  """Frequencies of the integer samples in [0, num_categories), float64."""
  samples = np.asarray(samples).ravel()
  if samples.size == 0:
    raise ValueError("samples must not be empty")
  counts = np.bincount(samples, minlength=num_categories)
  if counts.shape[0] != num_categories:
    raise ValueError(f"samples contain values >= num_categories={num_categories}")
  return counts / samples.size


def tv_distance(p, q) -> np.ndarray:
  """Total variation 0.5 * sum |p - q| over the last axis."""
  return 0.5 * np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum(axis=-1)


class ChiSquareResult(NamedTuple):
  statistic: float
  dof: int
  pvalue: float


def chi_square_test(counts, expected_probs, min_expected: float = 5.0) -> ChiSquareResult:
  """Pearson goodness of fit of category counts to expected probabilities.

  The chi-square approximation needs expected counts of about 5 or more, so
  categories are pooled: sorted by expected count, consecutive categories are
  merged until each pool reaches `min_expected` (a short last pool joins the
  previous one). Categories of expected probability 0 are checked exactly
  instead: a single observation there refutes the hypothesis (statistic inf,
  p-value 0), and otherwise they carry no information and are dropped.
  dof = pools - 1; with a single pool nothing is testable (p-value 1).
  """
  counts = np.asarray(counts, dtype=np.float64)
  probs = _as_distribution(expected_probs, "expected_probs")
  if counts.shape != probs.shape or counts.ndim != 1:
    raise ValueError(f"counts {counts.shape} and expected_probs {probs.shape} "
                     "must be matching 1-D arrays")
  if np.any(counts[probs == 0] > 0):
    return ChiSquareResult(math.inf, 0, 0.0)
  support = probs > 0
  counts, expected = counts[support], probs[support] * counts.sum()
  pools_obs, pools_exp = [], []
  obs_acc = exp_acc = 0.0
  for i in np.argsort(expected, kind="stable"):
    obs_acc += counts[i]
    exp_acc += expected[i]
    if exp_acc >= min_expected:
      pools_obs.append(obs_acc)
      pools_exp.append(exp_acc)
      obs_acc = exp_acc = 0.0
  if exp_acc > 0:
    if pools_exp:
      pools_obs[-1] += obs_acc
      pools_exp[-1] += exp_acc
    else:
      pools_obs.append(obs_acc)
      pools_exp.append(exp_acc)
  obs, exp = np.asarray(pools_obs), np.asarray(pools_exp)
  dof = obs.size - 1
  if dof < 1:
    return ChiSquareResult(0.0, 0, 1.0)
  statistic = float(np.sum((obs - exp) ** 2 / exp))
  return ChiSquareResult(statistic, dof, float(stats.chi2.sf(statistic, dof)))


def tv_noise_bound(num_categories: int, num_samples: int, confidence: float = 0.999) -> float:
  """TV that the empirical law of an exact sampler stays below, w.p. >= confidence.

  For N iid samples from p over C categories with empirical law p_N:

    E[TV(p_N, p)] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / N) <= 0.5 * sqrt((C - 1) / N)

  (Jensen per category, then Cauchy-Schwarz with sum_i p_i (1 - p_i) <=
  1 - 1/C). Changing one sample moves TV by at most 1/N, so McDiarmid's
  inequality gives P(TV >= E[TV] + t) <= exp(-2 N t^2). Hence

    bound = 0.5 * sqrt((C - 1) / N) + sqrt(log(1 / (1 - confidence)) / (2 N)).

  Distribution-free (valid for every p), hence conservative.
  """
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  n = float(num_samples)
  expected = 0.5 * math.sqrt((num_categories - 1) / n)
  return expected + math.sqrt(math.log(1.0 / (1.0 - confidence)) / (2.0 * n))


def detectable_tv(num_categories: int, num_samples: int, confidence: float = 0.999,
                  power: float = 0.99) -> float:
  """Smallest TV from p that the test "TV(p_N, p) > tv_noise_bound" is sure to catch.

  If the sampler's law r has TV(r, p) >= eps, then TV(p_N, p) >= eps -
  TV(p_N, r), and TV(p_N, r) <= tv_noise_bound(C, N, power) with probability
  >= power. So with

    eps = tv_noise_bound(C, N, confidence) + tv_noise_bound(C, N, power)

  the TV test rejects with probability >= power, while an exact sampler passes
  with probability >= confidence. A sufficient, distribution-free figure: the
  chi-square test usually detects smaller deviations.
  """
  return tv_noise_bound(num_categories, num_samples, confidence) + tv_noise_bound(
      num_categories, num_samples, power)


def randomized_pit(u_lower, p_x, uniforms) -> np.ndarray:
  """Randomized probability integral transform u = F(x-1) + U * p(x).

  For a discrete x with CDF F under the claimed law (u_lower = F(x-1), the
  mass strictly before x; p_x = P(x)) and U ~ Uniform(0, 1) independent, u is
  exactly Uniform(0, 1) iff x follows the claimed law. Pooling u over many
  positions with different laws (e.g. every step of a generation, each
  against the target's distribution at that step) gives one uniformity test.
  """
  u_lower, p_x = np.asarray(u_lower, np.float64), np.asarray(p_x, np.float64)
  return u_lower + np.asarray(uniforms, np.float64) * p_x


class UniformityResult(NamedTuple):
  statistic: float
  pvalue: float


def uniformity_test(values) -> UniformityResult:
  """Kolmogorov-Smirnov test of values against Uniform(0, 1)."""
  res = stats.kstest(np.asarray(values, np.float64).ravel(), "uniform")
  return UniformityResult(float(res.statistic), float(res.pvalue))


def holm_bonferroni(pvalues, alpha: float = 0.05) -> np.ndarray:
  """Holm's step-down procedure; returns which hypotheses are rejected.

  Sort the m p-values ascending; reject H_(k) (k = 0, 1, ...) while
  p_(k) <= alpha / (m - k), stopping at the first that is not. Controls the
  family-wise error rate at alpha under any dependence. Result is a boolean
  array in the input order.
  """
  pvalues = np.asarray(pvalues, np.float64).ravel()
  m = pvalues.size
  rejected = np.zeros(m, dtype=bool)
  for k, i in enumerate(np.argsort(pvalues, kind="stable")):
    if pvalues[i] > alpha / (m - k):
      break
    rejected[i] = True
  return rejected
