"""specjax.sampling on hand-made logits: processing, greedy ties, draws, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling
from specjax.errors import ConfigValueError
from specjax.sampling import SamplingConfig


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _support(p):
  return set(np.flatnonzero(np.asarray(p) > 0).tolist())


LOGITS = jnp.array([1.0, 3.0, -2.0, 0.5, 2.0, -1.0], jnp.float32)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_logits(temperature):
  p = sampling.probs(LOGITS, SamplingConfig(temperature=temperature))
  np.testing.assert_allclose(p, _softmax(np.asarray(LOGITS) / temperature), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature", [1e-10, 1e-30])
def test_a_tiny_temperature_is_the_greedy_limit_under_jit(temperature):
  # logits / T near 1e11 used to round differently in the max and in the
  # element (one ulp ~1e4 there): exp overflowed, softmax gave NaN and the
  # inverse CDF silently drew token 0. The limit is the argmax's one-hot.
  logits = jnp.array([[-11.8, 13.79, 3.0, 13.5], [40.0, -35.0, 12.0, 39.9]], jnp.float32)
  cfg = SamplingConfig(temperature=temperature)
  p = jax.jit(lambda x: sampling.probs(x, cfg))(logits)
  np.testing.assert_array_equal(p, np.eye(4, dtype=np.float32)[[1, 0]])
  u = jnp.array([0.0, 0.999], jnp.float32)
  np.testing.assert_array_equal(sampling.inverse_cdf(p, u), [1, 0])


def test_top_k_keeps_the_k_largest():
  p = sampling.probs(LOGITS, SamplingConfig(top_k=2))
  assert _support(p) == {1, 4}
  np.testing.assert_allclose(p[jnp.array([1, 4])], _softmax([3.0, 2.0]), rtol=1e-6)


def test_top_k_keeps_every_tie_at_the_kth_value():
  # Ties at the k-th logit are all kept (cutting one of them would pick an
  # arbitrary winner), so more than k tokens may survive.
  logits = jnp.array([2.0, 1.0, 1.0, 0.0])
  assert _support(sampling.probs(logits, SamplingConfig(top_k=2))) == {0, 1, 2}


@pytest.mark.parametrize("top_k", [0, 6, 100])
def test_top_k_zero_or_at_least_vocab_is_a_no_op(top_k):
  np.testing.assert_allclose(sampling.probs(LOGITS, SamplingConfig(top_k=top_k)),
                             _softmax(LOGITS), rtol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_top_p():
  # Sorted probabilities 0.5, 0.25, 0.125, 0.125 (up to float32 softmax
  # round-off, hence the 1e-4 margins around each boundary).
  logits = jnp.log(jnp.array([0.125, 0.5, 0.125, 0.25]))
  cases = [
      (1e-6, {1}),  # the top token always stays
      (0.5 - 1e-4, {1}),
      (0.5 + 1e-4, {1, 3}),  # mass before token 3 is 0.5 < top_p
      (0.75 - 1e-4, {1, 3}),
      # Of the two tied 0.125 tokens only the first in sort order (the lower
      # index: the sort is stable) is needed to reach 0.75.
      (0.75 + 1e-4, {0, 1, 3}),
      (1.0, {0, 1, 2, 3}),
  ]
  for top_p, expected in cases:
    p = sampling.probs(logits, SamplingConfig(top_p=top_p))
    assert _support(p) == expected, top_p
    np.testing.assert_allclose(float(p.sum()), 1.0, rtol=1e-6)


def _nucleus_reference(logits, top_p):
  """float64 NumPy nucleus by the definition (stable descending sort)."""
  x = np.asarray(logits, np.float64)
  keep = np.zeros(x.shape, bool)
  for r, row in enumerate(x):
    order = np.argsort(-row, kind="stable")
    p = _softmax(row[order])
    keep[r, order] = (np.cumsum(p) - p) < top_p
  return keep


@pytest.mark.parametrize("top_p,medium", [(0.5, 2.0), (0.9, 3.0)])
def test_nucleus_from_candidates_equals_the_full_sort(top_p, medium):
  # V = 1024 with candidate counts (16, 128): peaked rows are decided by the
  # top 16, medium rows by the top 128, flat rows need the full sort; ties
  # (rounded logits) straddle the candidate cut. Each way must give the set
  # the definition gives.
  rng = np.random.default_rng(0)
  scale = np.array([8.0] * 4 + [medium] * 4 + [0.05] * 4)[:, None]
  logits = np.round(rng.standard_normal((12, 1024)) * scale, 1).astype(np.float32)
  fn = jax.jit(lambda x: sampling.nucleus(x, top_p, (16, 128)))
  want = _nucleus_reference(logits, top_p)
  mass = np.sort(_softmax(logits), -1)[:, ::-1].cumsum(-1)
  levels = [(mass[:, 15] >= top_p), (mass[:, 127] >= top_p)]
  for rows in (slice(0, 4), slice(4, 8), slice(8, 12), slice(0, 12)):  # each level, all
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(logits[rows]))), want[rows])
  assert levels[0][:4].all() and not levels[0][4:].any() and levels[1][4:8].all()
  assert not levels[1][8:].any()
  # probs goes through the same function: its support is the nucleus
  p = sampling.probs(jnp.asarray(logits), SamplingConfig(top_p=top_p))
  np.testing.assert_array_equal(np.asarray(p) > 0, want)


def test_top_k_threshold_on_a_large_vocabulary():
  # top_k over SmolLM2-sized rows: exactly the k largest (distinct values).
  logits = jax.random.normal(jax.random.key(0), (3, 49152))
  p = np.asarray(sampling.probs(logits, SamplingConfig(top_k=50)))
  top = np.argsort(-np.asarray(logits), -1)[:, :50]
  for r in range(3):
    assert _support(p[r]) == set(top[r].tolist())


def test_top_p_renormalises_the_kept_tokens():
  logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
  p = sampling.probs(logits, SamplingConfig(top_p=0.7))
  np.testing.assert_allclose(p, [0.625, 0.375, 0.0], rtol=1e-5, atol=1e-7)


def test_top_k_then_top_p_on_the_truncated_distribution():
  # top-k runs first; top-p then sees the renormalised top-k distribution.
  logits = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
  p = sampling.probs(logits, SamplingConfig(top_k=2, top_p=0.5))
  # After top-2: (4/7, 3/7); 4/7 >= 0.5, so only token 0 stays.
  assert _support(p) == {0}


def test_greedy_tie_breaks_to_first_index():
  logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
  np.testing.assert_array_equal(sampling.probs(logits, sampling.GREEDY),
                                [[0, 1, 0, 0], [1, 0, 0, 0]])
  np.testing.assert_array_equal(sampling.sample(jax.random.key(0), logits, sampling.GREEDY), [1, 0])


def test_greedy_ignores_top_k_and_top_p():
  cfg = SamplingConfig(temperature=0.0, top_k=3, top_p=0.1)
  np.testing.assert_array_equal(sampling.probs(LOGITS, cfg), jax.nn.one_hot(1, 6))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=float("inf")), "top_k"),
    (dict(top_k=float("nan")), "top_k"),
])
def test_invalid_settings_raise_naming_the_field(kwargs, field):
  with pytest.raises(ConfigValueError, match=field):
    SamplingConfig(**kwargs)


def test_config_is_a_static_jit_argument():
  f = jax.jit(sampling.probs, static_argnums=1)
  cfg = SamplingConfig(temperature=0.7, top_k=3)
  assert hash(cfg) == hash(SamplingConfig(temperature=0.7, top_k=3))
  np.testing.assert_allclose(f(LOGITS, cfg), sampling.probs(LOGITS, cfg), rtol=1e-6)


@pytest.mark.parametrize("p, u, expected", [
    ([0.0, 0.5, 0.0, 0.5], 0.0, 1),  # u = 0 lands on the first token with mass
    ([0.0, 0.5, 0.0, 0.5], 0.49, 1),
    ([0.0, 0.5, 0.0, 0.5], 0.51, 3),
    ([0.5, 0.5, 0.0, 0.0], 1.0 - 2.0**-24, 1),  # never past the last positive entry
    ([0.2, 0.2], 0.6, 1),  # unnormalised rows are scaled, not divided
    ([0.1, 0.1, 0.2], 0.45, 1),  # u * total = 0.18 < CDF(1) = 0.2
    ([0.1, 0.1, 0.2], 0.55, 2),
])
def test_inverse_cdf_hand_cases(p, u, expected):
  assert int(sampling.inverse_cdf(jnp.array(p, jnp.float32), jnp.float32(u))) == expected


def test_sample_from_probs_is_inverse_cdf_of_one_uniform_per_row():
  # Pinned down so float64 references (analysis.exactness) can replay draws.
  p = jnp.array(np.random.default_rng(0).dirichlet(np.ones(7), size=(3, 5)), jnp.float32)
  key = jax.random.key(3)
  u = jax.random.uniform(key, (3, 5, 1), jnp.float32)[..., 0]
  np.testing.assert_array_equal(sampling.sample_from_probs(key, p), sampling.inverse_cdf(p, u))


def test_sample_from_probs_frequencies_and_zero_entries():
  p = np.array([0.0, 0.1, 0.0, 0.6, 0.3, 0.0], np.float32)
  rows = jnp.broadcast_to(p, (40_000, 6))
  draws = np.asarray(sampling.sample_from_probs(jax.random.key(1), rows))
  assert _support(np.bincount(draws, minlength=6)) == {1, 3, 4}
  np.testing.assert_allclose(np.bincount(draws, minlength=6) / draws.size, p, atol=0.01)


def test_sample_draws_from_processed_probs():
  cfg = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)
  logits = jnp.broadcast_to(LOGITS, (16, 6))
  key = jax.random.key(7)
  np.testing.assert_array_equal(sampling.sample(key, logits, cfg),
                                sampling.sample_from_probs(key, sampling.probs(logits, cfg)))
