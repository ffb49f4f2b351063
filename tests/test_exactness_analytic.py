"""specjax.analysis.exactness: exact laws, the float64 reference of Algorithm 1,
and the statistical tests themselves (which must pass exact samplers and
reject wrong ones)."""

import dataclasses
import itertools

import numpy as np
import pytest
from scipy import stats

from specjax.analysis import exactness as ex
from specjax.analysis import vetting
from specjax.errors import ConfigValueError


def _onehot(i, V):
  return np.eye(V)[i]


@pytest.mark.parametrize("V, alpha", [(8, 1.0), (16, 0.3), (16, 3.0)])
def test_chain_output_distribution_is_p_for_random_pairs(V, alpha):
  rng = np.random.default_rng(V)
  p = rng.dirichlet(np.full(V, alpha), size=200)
  q = rng.dirichlet(np.full(V, alpha), size=200)
  np.testing.assert_allclose(ex.chain_output_distribution(p, q), p, rtol=0, atol=1e-12)


def _adversarial_pairs(V=8):
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(V))
  q = rng.dirichlet(np.ones(V))
  p_sparse = np.where(np.arange(V) < 3, p, 0.0)
  p_sparse /= p_sparse.sum()
  q_sparse = np.where(np.arange(V) >= 5, q, 0.0)
  q_sparse /= q_sparse.sum()
  yield "q = 0 where p > 0", p, np.roll(p_sparse, 4)
  yield "p = 0 where q > 0", p_sparse, q
  for i in range(V):
    yield f"one-hot q at {i}", p, _onehot(i, V)
  yield "one-hot q at a p = 0 token", p_sparse, _onehot(V - 1, V)
  yield "one-hot p", _onehot(2, V), q
  yield "one-hot p and q, equal", _onehot(2, V), _onehot(2, V)
  yield "one-hot p and q, different", _onehot(2, V), _onehot(5, V)
  yield "identical", p, p.copy()
  yield "disjoint supports", p_sparse, q_sparse
  yield "uniform q", p_sparse, np.full(V, 1.0 / V)


ADVERSARIAL = list(_adversarial_pairs())


@pytest.mark.parametrize("name, p, q", ADVERSARIAL, ids=[case[0] for case in ADVERSARIAL])
def test_chain_output_distribution_is_p_for_adversarial_pairs(name, p, q):
  np.testing.assert_allclose(ex.chain_output_distribution(p, q), p, rtol=0, atol=1e-12)


def test_chain_output_distribution_rejects_non_distributions():
  with pytest.raises(ValueError, match="p must"):
    ex.chain_output_distribution([0.5, 0.6], [0.5, 0.5])
  with pytest.raises(ValueError, match="q must"):
    ex.chain_output_distribution([0.5, 0.5], [1.5, -0.5])


def test_reference_inverse_cdf():
  p = [0.0, 0.5, 0.0, 0.5, 0.0]
  assert ex.reference_inverse_cdf(p, 0.0) == 1
  assert ex.reference_inverse_cdf(p, 0.49) == 1
  assert ex.reference_inverse_cdf(p, 0.5) == 3  # cdf <= u counts: ties go up
  assert ex.reference_inverse_cdf(p, 1.0) == 3  # clipped to the last positive entry
  assert ex.reference_inverse_cdf([0.2, 0.2], 0.6) == 1  # unnormalised


def test_reference_algorithm1_hand_cases():
  p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
  q = np.array([[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
  # Guess 0 at slot 0: p/q = 2, kept whatever u; guess 0 at slot 1: p/q = 0.2.
  assert ex.reference_algorithm1(p, q, [0, 0], [0.99, 0.1], 0.3) == (2, 2)  # bonus
  # Slot 1 rejected (u = 0.5 > 0.2): residual (0, 0.3, 0.5), 0.3 * 0.8 -> token 1.
  assert ex.reference_algorithm1(p, q, [0, 0], [0.99, 0.5], 0.3) == (1, 1)
  # Slot 0 guess 2 (p = 0): rejected even with u = 0 (strict test).
  assert ex.reference_algorithm1(p, q, [2, 0], [0.0, 0.0], 0.9) == (0, 1)
  assert ex.reference_algorithm1(p, q, [0, 0], [0.5, 0.5], 0.9, num_proposed=0) == (0, 1)
  assert ex.reference_algorithm1(p, q, [0, 0], [0.5, 0.5], 0.1, num_proposed=1) == (1, 0)


def test_reference_algorithm1_law_is_p():
  """Integrating the reference over its uniforms (midpoint grids, exact up to
  the grid step) and over x ~ q gives p at the first position."""
  rng = np.random.default_rng(5)
  V = 5
  p = rng.dirichlet(np.ones(V), size=2)
  q = rng.dirichlet(np.ones(V), size=1)
  grid = (np.arange(1000) + 0.5) / 1000
  law = np.zeros(V)
  for x in range(V):
    accepted = [ex.reference_algorithm1(p, q, [x], [u], 0.0)[0] == 1 for u in grid]
    accept_prob = np.mean(accepted)
    law[x] += q[0, x] * accept_prob
    if accept_prob < 1:
      u_reject = grid[accepted.index(False)]  # the residual draw does not depend on u
      for ud in grid:
        law[ex.reference_algorithm1(p, q, [x], [u_reject], ud)[1]] += (
            q[0, x] * (1 - accept_prob) / grid.size)
  np.testing.assert_allclose(law, p[0], atol=2 / grid.size)


def test_joint_distribution_exact():
  p0, p1 = np.array([0.2, 0.8]), np.array([0.6, 0.4])
  np.testing.assert_allclose(ex.joint_distribution_exact(lambda prefix: p1 if prefix else p0, 2),
                             np.outer(p0, p1), atol=1e-15)

  def next_probs(prefix):  # token 0 is absorbing; otherwise depends on the last token
    if prefix and prefix[-1] == 0:
      return [1.0, 0.0, 0.0]
    return [0.1, 0.3, 0.6] if not prefix or prefix[-1] == 1 else [0.5, 0.5, 0.0]

  joint = ex.joint_distribution_exact(next_probs, 3, prefix=(2,))
  assert joint.shape == (3, 3, 3)
  np.testing.assert_allclose(joint.sum(), 1.0, atol=1e-15)
  np.testing.assert_allclose(joint[0, 0, 0], 0.5)
  np.testing.assert_allclose(joint[1, 2, 0], 0.5 * 0.6 * 0.5)
  assert joint[2].sum() == 0.0  # p(2 | ..., 2) = 0


def test_empirical_distribution_and_tv():
  np.testing.assert_allclose(ex.empirical_distribution([0, 2, 2, 3], 5), [0.25, 0, 0.5, 0.25, 0])
  with pytest.raises(ValueError, match="num_categories"):
    ex.empirical_distribution([0, 5], 5)
  assert ex.tv_distance([0.5, 0.5, 0.0], [0.0, 0.5, 0.5]) == pytest.approx(0.5)
  np.testing.assert_allclose(ex.tv_distance(np.eye(3), np.eye(3)[::-1]), [1.0, 0.0, 1.0])


def test_chi_square_matches_scipy_without_pooling():
  counts = np.array([30, 22, 25, 23])
  probs = np.full(4, 0.25)
  res = ex.chi_square_test(counts, probs)
  ref = stats.chisquare(counts, counts.sum() * probs)
  assert res.dof == 3
  assert res.statistic == pytest.approx(ref.statistic)
  assert res.pvalue == pytest.approx(ref.pvalue)


def test_chi_square_pools_small_bins_and_refutes_impossible_counts():
  probs = np.array([0.9, 0.05, 0.03, 0.01, 0.01, 0.0])
  counts = np.array([92, 3, 3, 1, 1, 0])
  res = ex.chi_square_test(counts, probs)  # expected 90, 5, 3, 1, 1: pools {1,1,3} and 5, 90
  assert res.dof == 2
  assert res.pvalue > 0.05
  counts_bad = np.array([91, 3, 3, 1, 1, 1])  # one draw where the law has no mass
  assert ex.chi_square_test(counts_bad, probs) == ex.ChiSquareResult(np.inf, 0, 0.0)
  assert ex.chi_square_test([3, 1], [0.5, 0.5], min_expected=5).pvalue == 1.0  # nothing to test


def test_chi_square_passes_exact_and_rejects_shifted_samples():
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.ones(12))
  shifted = 0.95 * p + 0.05 * np.roll(p, 1)
  pvals = [ex.chi_square_test(rng.multinomial(100_000, p), p).pvalue for _ in range(20)]
  assert min(pvals) > 1e-3
  assert ex.chi_square_test(rng.multinomial(100_000, shifted), p).pvalue < 1e-6


def test_tv_noise_bound_holds_for_exact_samplers():
  rng = np.random.default_rng(2)
  C, N = 16, 5_000
  bound = ex.tv_noise_bound(C, N, confidence=0.99)
  for alpha in (0.2, 1.0, 10.0):
    p = rng.dirichlet(np.full(C, alpha))
    tvs = ex.tv_distance(rng.multinomial(N, p, size=500) / N, p)
    assert np.all(tvs < bound)
  # Shrinks like 1/sqrt(N); grows with confidence and the number of categories.
  assert ex.tv_noise_bound(C, 4 * N) == pytest.approx(ex.tv_noise_bound(C, N) / 2)
  assert ex.tv_noise_bound(C, N, 0.999) > ex.tv_noise_bound(C, N, 0.9)
  assert ex.tv_noise_bound(2 * C, N) > ex.tv_noise_bound(C, N)
  assert ex.detectable_tv(C, N) > ex.tv_noise_bound(C, N)
  with pytest.raises(ValueError, match="confidence"):
    ex.tv_noise_bound(C, N, confidence=1.0)


def test_detectable_tv_is_detected():
  rng = np.random.default_rng(3)
  C, N = 8, 20_000
  p = rng.dirichlet(np.ones(C))
  eps = ex.detectable_tv(C, N, confidence=0.999, power=0.99)
  # Move eps of mass from the largest entry to the smallest.
  r = p.copy()
  r[np.argmax(p)] -= eps
  r[np.argmin(p)] += eps
  assert ex.tv_distance(p, r) == pytest.approx(eps)
  tvs = ex.tv_distance(rng.multinomial(N, r, size=200) / N, p)
  assert np.all(tvs > ex.tv_noise_bound(C, N, 0.999))


def test_randomized_pit_is_uniform_only_under_the_claimed_law():
  rng = np.random.default_rng(4)
  p = np.array([0.5, 0.0, 0.2, 0.3])
  cdf_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
  x = rng.choice(4, size=20_000, p=p)
  u = ex.randomized_pit(cdf_before[x], p[x], rng.random(x.size))
  assert ex.uniformity_test(u).pvalue > 1e-3
  wrong = rng.choice(4, size=20_000, p=[0.45, 0.0, 0.25, 0.3])
  u_wrong = ex.randomized_pit(cdf_before[wrong], p[wrong], rng.random(wrong.size))
  assert ex.uniformity_test(u_wrong).pvalue < 1e-6


def test_uniformity_test():
  rng = np.random.default_rng(6)
  assert ex.uniformity_test(rng.random(10_000)).pvalue > 1e-3
  assert ex.uniformity_test(rng.beta(2.0, 2.0, 10_000)).pvalue < 1e-6


def test_holm_bonferroni():
  # Sorted: 0.005 <= 0.05/4, 0.01 <= 0.05/3, 0.03 > 0.05/2: stop.
  np.testing.assert_array_equal(ex.holm_bonferroni([0.01, 0.04, 0.03, 0.005], 0.05),
                                [True, False, False, True])
  np.testing.assert_array_equal(ex.holm_bonferroni([0.01, 0.02, 0.03], 0.07), [True, True, True])
  np.testing.assert_array_equal(ex.holm_bonferroni([0.5, 0.9]), [False, False])
  # Step-down stops at the first non-rejection even if a later one would pass.
  # Sorted: 0.01 <= 0.09/3, 0.05 > 0.09/2: stop, though 0.05 <= 0.09/1.
  np.testing.assert_array_equal(ex.holm_bonferroni([0.05, 0.01, 0.05], 0.09), [False, True, False])
  assert ex.holm_bonferroni([], 0.05).shape == (0,)


def test_holm_bonferroni_controls_family_wise_error():
  rng = np.random.default_rng(7)
  false_rejections = sum(ex.holm_bonferroni(rng.random(20), 0.05).any() for _ in range(2000))
  assert false_rejections / 2000 < 0.07


def test_exactness_matrix_takes_its_settings_dataclass(load_config):
  """configs/exactness.py's defaults are vetting.MatrixSettings'; a ConfigDict
  is refused (experiments/exactness.py reads it into MatrixSettings once)."""
  assert vetting.MatrixSettings.of(load_config("exactness.py")) == vetting.MatrixSettings()
  quick = vetting.MatrixSettings.of(load_config("exactness.py", "quick"))
  assert (quick.drafters, quick.samplings, quick.ks, quick.batch_sizes) == (
      "draft_model", "T1=1.0/0/1.0", "3", "1")
  with pytest.raises(TypeError, match="MatrixSettings"):
    vetting.run_matrix(load_config("exactness.py", "quick"), log=lambda line: None)
  # settings out of range are refused by name before the tiny pair is built (num_samples 0
  # was an IndexError, batch_sizes past the 4 prompts silently ran fewer rows)
  for fields, match in ((dict(num_samples=0), "num_samples must be a whole number >= 1"),
                        (dict(family_alpha=-1.0), r"family_alpha must be .* \(0, 1\)"),
                        (dict(batch_sizes="1,5"), "batch_sizes='1,5'.*<= 4"),
                        (dict(ks="0"), "ks='0'.*>= 1"),
                        (dict(samplings="T1=1.0/0"), "'T1=1.0/0' is not name=temperature"),
                        (dict(drafters="medusa"), r"unknown \['medusa'\]")):
    with pytest.raises(ConfigValueError, match=match):
      vetting.run_matrix(dataclasses.replace(quick, **fields), log=lambda line: None)
