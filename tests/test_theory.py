"""The speed theory: closed forms against enumeration, and the cost-optimal
draft length read off a measured acceptance histogram."""

import numpy as np
import pytest

from specjax.analysis import theory


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_expected_tokens_matches_enumeration(alpha, k):
  # P(accept exactly n) = alpha^n (1 - alpha) for n < k, alpha^k for n = k.
  probs = [alpha ** n * (1 - alpha) for n in range(k)] + [alpha ** k]
  enum = sum((n + 1) * p for n, p in enumerate(probs))
  assert float(theory.expected_tokens(alpha, k)) == pytest.approx(enum, rel=1e-9)


def test_histogram_cut_to_shorter_chains_equals_the_closed_form():
  alpha, k = 0.7, 5
  hist = np.array([alpha ** n * (1 - alpha) for n in range(k)] + [alpha ** k]) * 1e6
  for kk in range(1, k + 1):
    assert theory.chain_tokens_from_histogram(hist, kk) == pytest.approx(
        float(theory.expected_tokens(alpha, kk)), rel=1e-9)
  assert np.isnan(theory.chain_tokens_from_histogram([0, 0, 0], 2))


def test_best_chain_length_follows_the_cost_curve():
  alpha, k = 0.6, 6
  hist = np.array([alpha ** n * (1 - alpha) for n in range(k)] + [alpha ** k]) * 1e6
  flat = {n: 1.0 for n in range(1, k + 2)}
  kb, sb, vals = theory.best_chain_length(hist, k, flat, t_draft=0.0)
  assert kb == k and sb == pytest.approx(float(theory.expected_tokens(alpha, k)))
  # A verify that grows 30% per token and a draft of 0.1 per guess: enumerate.
  steep = {n: 1.0 + 0.3 * (n - 1) for n in range(1, k + 2)}
  kb, sb, vals = theory.best_chain_length(hist, k, steep, t_draft=0.1 * k)
  brute = {kk: float(theory.expected_tokens(alpha, kk)) / (0.1 * kk + steep[kk + 1])
           for kk in range(1, k + 1)}
  assert kb == max(brute, key=brute.get) and kb < k
  assert vals == pytest.approx(brute)
  # unmeasured widths are interpolated linearly (the curve here is linear)
  sparse = {n: steep[n] for n in (1, 2, 4, k + 1)}
  assert theory.best_chain_length(hist, k, sparse, t_draft=0.1 * k)[2] == pytest.approx(brute)


def test_greedy_rounds_walks_the_sequence_as_decoding_does():
  k = 4
  assert theory.greedy_rounds(np.ones((10, k), bool)) == (10, 2)  # two rounds of k + 1
  assert theory.greedy_rounds(np.zeros((7, k), bool)) == (7, 7)  # one token a round
  # an easy stretch then a hard one: decoding crosses the first in 2 rounds and
  # spends 10 on the second, so its tau (20 / 12) is well below the mean over starts (3)
  mixed = np.concatenate([np.ones((10, k), bool), np.zeros((10, k), bool)])
  assert theory.greedy_rounds(mixed) == (20, 12)
  assert 1 + np.cumprod(mixed, 1).sum(1).mean() == 3.0
  # a round accepts the leading run only: start 0 accepts 2 (its 3rd guess is wrong),
  # the next round starts at 3; start 1's perfect chain is never a round
  c = np.array([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1], [0, 1, 1, 1]], bool)
  assert theory.greedy_rounds(c) == (3 + 2, 2)
  with pytest.raises(ValueError, match="starts, k"):
    theory.greedy_rounds(np.ones(5, bool))


def test_leviathan_improvement_factor():
  # Theorem 3.8 at c = 0 is the expected tokens; the optimum moves down as c grows.
  assert float(theory.leviathan_speedup(0.8, 4, 0.0)) == pytest.approx(
      float(theory.expected_tokens(0.8, 4)))
  ks = [theory.optimal_k(0.8, c) for c in (0.01, 0.1, 0.5)]
  assert ks[0] >= ks[1] >= ks[2] >= 1 and ks[0] > ks[2]


def test_best_tree_budget_follows_the_cost_curve():
  values = [0.5, 0.3, 0.2, 0.1, 0.05, 0.02]
  flat = {1: 1.0, 8: 1.0}  # verify as cheap at 7 tokens as at 1: take every node
  n, s, vals = theory.best_tree_budget(values, flat, 0.1)
  assert n == 6 and np.isclose(s, (1 + sum(values)) / 1.1)
  steep = {1: 1.0, 2: 1.3, 8: 4.0}  # each node costs a lot: only the best pay
  n, s, vals = theory.best_tree_budget(values, steep, 0.1)
  assert n == 1 and np.isclose(vals[1], 1.5 / 1.4)
  assert vals[1] > vals[2] > vals[6]
  with pytest.raises(ValueError, match="no budget"):
    theory.best_tree_budget(values, {1: 1.0}, 0.1)


def test_medusa_tree_node_values_match_the_tree():
  from specjax.drafters.medusa import tree_from_accuracies, tree_node_values
  acc = [[0.6, 0.2], [0.5, 0.1]]
  assert tree_from_accuracies(acc, 3) == ((0,), (1,), (0, 0))
  np.testing.assert_allclose(tree_node_values(acc, 3), [0.6, 0.3, 0.2])
