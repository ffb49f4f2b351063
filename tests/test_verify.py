"""Acceptance rules: hand cases, differential tests against a float64
transcription of Leviathan et al. Algorithm 1, and Monte-Carlo exactness with
negative controls (deliberately broken rules the same test must reject)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling, verify
from specjax.analysis import exactness as ex

K, V = 3, 8
chain_with_uniforms = jax.jit(verify.chain_accept_with_uniforms)
chain_accept = jax.jit(verify.chain_accept)


def _dist(*entries):
  """A length-V float32 distribution from its leading entries (rest zero)."""
  out = np.zeros(V, np.float32)
  out[:len(entries)] = entries
  return out


# Residual max(0, P - Q) = (0.3, 0.1, 0, ...): normalised (0.75, 0.25).
P = _dist(0.4, 0.3, 0.1, 0.2)
Q = _dist(0.1, 0.2, 0.5, 0.2)
BONUS = _dist(0, 0, 0, 0, 0.5, 0.5)
# Equal up to one float32 ulp in two tiny entries: a residual of mass ~1e-13
# that the rule must treat as empty (draw from p instead).
Q_TINY = _dist(0.5, 0.25 - 2e-6, 0.25, 1e-6, 1e-6)
P_TINY = Q_TINY.copy()
P_TINY[3] = np.nextafter(Q_TINY[3], np.float32(0))
P_TINY[4] = np.nextafter(Q_TINY[4], np.float32(1))


def _row(p, q, x, u, u_draw, num_proposed):
  p = np.stack([np.asarray(r, np.float32) for r in p])
  q = np.stack([np.asarray(r, np.float32) for r in q])
  return p, q, np.asarray(x, np.int32), np.asarray(u, np.float32), np.float32(u_draw), num_proposed


# (name, row, expected (num_accepted, next_token)), one row per branch.
HAND_CASES = [
    ("accept all, bonus",
     _row([P, P, P, BONUS], [Q, Q, Q], [0, 0, 0], [0.9, 0.9, 0.9], 0.75, 3), (3, 5)),
    # p/q = 0.2 at token 2; u = 0.9 rejects. Residual cdf (0.3, 0.4): 0.9 * 0.4 -> token 1.
    ("reject at 0",
     _row([P, P, P, BONUS], [Q, Q, Q], [2, 0, 0], [0.9, 0.1, 0.1], 0.9, 3), (0, 1)),
    ("mid-chain reject",
     _row([P, P, P, BONUS], [Q, Q, Q], [0, 2, 0], [0.5, 0.9, 0.1], 0.5, 3), (1, 0)),
    ("reject at the last slot",
     _row([P, P, P, BONUS], [Q, Q, Q], [1, 2, 2], [0.5, 0.1, 0.99], 0.1, 3), (2, 0)),
    # Slot 2 would pass but was not proposed: bonus from p_2 = P, cdf (0.4, 0.7, ...) at 0.6.
    ("num_proposed < K",
     _row([P, P, P, BONUS], [Q, Q, Q], [0, 0, 0], [0.1, 0.1, 0.1], 0.6, 2), (2, 1)),
    ("num_proposed = 0",
     _row([P, P, P, BONUS], [Q, Q, Q], [0, 0, 0], [0.1, 0.1, 0.1], 0.05, 0), (0, 0)),
    # u = 0 and p(x) = 0 < q(x): the strict test must still reject.
    ("u = 0, p(x) = 0",
     _row([_dist(0, 1.0), P, P, BONUS], [Q, Q, Q], [0, 0, 0], [0.0, 0.1, 0.1], 0.3, 3), (0, 1)),
    # p == q exactly and q(x) = p(x) = 0: rejected, residual exactly empty -> draw from p.
    ("zero residual",
     _row([P, P, P, BONUS], [P, Q, Q], [5, 0, 0], [0.5, 0.1, 0.1], 0.5, 3), (0, 1)),
    # Largest float32 uniform below 1 rejects x = 3 (p/q one ulp under 1);
    # the residual has mass ~1e-13 -> draw from P_TINY: cdf (0.5, 0.75, ...) at 0.6.
    ("float-noise residual",
     _row([P_TINY, P, P, BONUS], [Q_TINY, Q, Q], [3, 0, 0], [1 - 2.0**-24, 0.1, 0.1], 0.6, 3),
     (0, 1)),
    # Deterministic drafter: one-hot q at token 1, p(1) = 0.3; u = 0.5 rejects,
    # residual = P without token 1, cdf (0.4, 0.4, 0.5, 0.7); u_draw 0.6 scales to
    # 0.42, which 2 entries do not exceed -> token 2.
    ("one-hot q",
     _row([P, P, P, BONUS], [_dist(0, 1.0), Q, Q], [1, 0, 0], [0.5, 0.1, 0.1], 0.6, 3), (0, 2)),
]


def _stack(rows):
  p, q, x, u, ud, n = zip(*rows)
  return (np.stack(u), np.array(ud, np.float32), np.stack(x), np.stack(q), np.stack(p),
          np.array(n, np.int32))


def _reference(u, u_draw, x, q, p, num_proposed):
  return np.array([ex.reference_algorithm1(p[b], q[b], x[b], u[b], u_draw[b], num_proposed[b])
                   for b in range(x.shape[0])], np.int64).reshape(-1, 2)


def test_hand_cases_match_expected_and_reference():
  u, ud, x, q, p, n = _stack([row for _, row, _ in HAND_CASES])
  got = np.stack([np.asarray(a) for a in chain_with_uniforms(u, ud, x, q, p, n)], axis=1)
  expected = np.array([e for _, _, e in HAND_CASES])
  ref = _reference(u, ud, x, q, p, n)
  for b, (name, _, _) in enumerate(HAND_CASES):
    assert tuple(ref[b]) == tuple(expected[b]), f"reference, {name}"
    assert tuple(got[b]) == tuple(expected[b]), f"chain_accept_with_uniforms, {name}"


def _random_case(seed, B=512):
  """Random rows covering every branch: sparse p and q, q == p rows, one-hot
  q rows, guesses drawn from q or arbitrary (q(x) = 0), ragged proposals."""
  rng = np.random.default_rng(seed)

  def sparse(shape):
    d = rng.dirichlet(np.full(V, 0.5), size=shape)
    d = np.where(rng.random(d.shape) < 0.3, 0.0, d)
    d[..., 0] += (d.sum(-1) == 0)
    return (d / d.sum(-1, keepdims=True)).astype(np.float32)

  p, q = sparse((B, K + 1)), sparse((B, K))
  same = rng.random(B) < 0.15
  q[same] = p[same, :K]
  cdf = np.cumsum(q.astype(np.float64), axis=-1)
  x = np.sum(cdf <= rng.random((B, K, 1)) * cdf[..., -1:], axis=-1)  # x ~ q
  arbitrary = rng.random((B, K)) < 0.1
  x = np.where(arbitrary, rng.integers(0, V, (B, K)), x).astype(np.int32)
  onehot = rng.random(B) < 0.15
  q[onehot] = np.eye(V, dtype=np.float32)[x[onehot]]
  u = rng.random((B, K)).astype(np.float32)
  ud = rng.random(B).astype(np.float32)
  n = rng.integers(0, K + 1, B).astype(np.int32)
  return u, ud, x, q, p, n


@pytest.mark.parametrize("seed", [0, 1])
def test_random_cases_match_reference(seed):
  u, ud, x, q, p, n = _random_case(seed)
  num_accepted, next_token = map(np.asarray, chain_with_uniforms(u, ud, x, q, p, n))
  ref = _reference(u, ud, x, q, p, n)
  np.testing.assert_array_equal(num_accepted, ref[:, 0])
  np.testing.assert_array_equal(next_token, ref[:, 1])
  # Every branch occurred: each acceptance count, rejections and bonuses.
  assert set(num_accepted.tolist()) == set(range(K + 1))
  assert np.any(num_accepted < n) and np.any(num_accepted == n)


def test_one_hot_q_is_the_point_proposal_rule():
  """A deterministic drafter (q one-hot at x) keeps x with probability p(x)
  and otherwise draws from p with x removed and renormalised."""
  u, ud, x, q, p, n = _random_case(2)
  q = np.eye(V, dtype=np.float32)[x]
  num_accepted, next_token = map(np.asarray, chain_with_uniforms(u, ud, x, q, p, n))
  for b in range(x.shape[0]):
    i = 0
    while i < n[b] and u[b, i] < p[b, i, x[b, i]]:
      i += 1
    if i < n[b]:
      without_x = p[b, i].astype(np.float64).copy()
      without_x[x[b, i]] = 0.0
      dist = without_x if without_x.sum() > 1e-12 else p[b, i]
    else:
      dist = p[b, i]
    assert (num_accepted[b], next_token[b]) == (i, ex.reference_inverse_cdf(dist, ud[b])), b


def test_one_hot_p_and_q_reduce_to_greedy():
  rng = np.random.default_rng(3)
  B = 512
  # Integer logits in a small range: many ties, which both rules break to
  # the first index.
  logits = rng.integers(0, 3, (B, K + 1, V)).astype(np.float32)
  p = sampling.probs(jnp.asarray(logits), sampling.GREEDY)
  target = np.argmax(logits, axis=-1)
  x = np.where(rng.random((B, K)) < 0.7, target[:, :K], rng.integers(0, V, (B, K))).astype(np.int32)
  q = np.eye(V, dtype=np.float32)[x]
  n = rng.integers(0, K + 1, B).astype(np.int32)
  u, ud = rng.random((B, K)).astype(np.float32), rng.random(B).astype(np.float32)
  got = chain_with_uniforms(u, ud, x, q, p, n)
  want = verify.greedy_accept(x, logits, n)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


def test_greedy_hand_cases():
  logits = np.full((5, K + 1, V), -1.0, np.float32)
  logits[:, :, 2] = 1.0  # argmax 2 everywhere ...
  logits[:, 3, 6] = 1.0  # ... except the bonus position: tie 2/6 -> first index, 2
  logits[1, 1, 7] = 5.0  # row 1: target wants 7 at slot 1
  x = np.array([[2, 2, 2], [2, 2, 2], [2, 2, 2], [0, 2, 2], [2, 2, 2]], np.int32)
  n = np.array([3, 3, 1, 3, 0], np.int32)
  num_accepted, next_token = verify.greedy_accept(x, logits, n)
  np.testing.assert_array_equal(num_accepted, [3, 1, 1, 0, 0])
  np.testing.assert_array_equal(next_token, [2, 7, 2, 2, 2])


def test_typical_accept_hand_cases():
  assert verify.LOSSY_RULES == frozenset({"typical"})
  uniform4 = _dist(0.25, 0.25, 0.25, 0.25)  # H = log 4: threshold min(0.09, 0.3 / 4) = 0.075
  peaked = _dist(0.93, 0.05, 0.02)  # p(1) = 0.05 < min(0.09, 0.3 exp(-H) ~ 0.22)
  p = np.stack([np.stack([uniform4, uniform4, peaked, P]), np.stack([uniform4, peaked, P, P])])
  x = np.array([[3, 0, 1], [1, 1, 0]], np.int32)
  num_accepted, next_token = verify.typical_accept(x, p, np.array([3, 3], np.int32))
  np.testing.assert_array_equal(num_accepted, [2, 1])
  np.testing.assert_array_equal(next_token, [0, 0])  # argmax of p_n, not a sample
  num_accepted, _ = verify.typical_accept(x, p, np.array([1, 0], np.int32))
  np.testing.assert_array_equal(num_accepted, [1, 0])


def test_accepted_mask():
  np.testing.assert_array_equal(verify.accepted_mask(jnp.array([0, 2, 3]), 3),
                                [[0, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_shape_mismatch_raises():
  u, ud, x, q, p, n = _stack([row for _, row, _ in HAND_CASES])
  with pytest.raises(ValueError, match="p must have shape"):
    verify.chain_accept_with_uniforms(u, ud, x, q, p[:, :K], n)
  with pytest.raises(ValueError, match="q must have shape"):
    verify.chain_accept_with_uniforms(u, ud, x, q[:, :2], p, n)


# ---------------------------------------------------------------------------
# Monte Carlo: the law of the emitted tokens is the target's.

N = 200_000
TARGET_CFG = sampling.SamplingConfig(temperature=0.8, top_k=6)


def _mc_problem():
  """Fixed target (processed with top-k, so p has zeros) and a full-support
  draft at TV 0.3-0.6 from it, guesses drawn from q, ragged num_proposed."""
  rng = np.random.default_rng(14)
  logits = rng.normal(0.0, 1.5, (K + 1, V)).astype(np.float32)
  draft_logits = (0.5 * logits[:K] + rng.normal(0.0, 1.0, (K, V))).astype(np.float32)
  p = np.asarray(sampling.probs(jnp.asarray(logits), TARGET_CFG))
  p_raw = np.asarray(jax.nn.softmax(logits, axis=-1))
  q = np.asarray(jax.nn.softmax(draft_logits, axis=-1))
  key = jax.random.key(2024)
  draft_key, verify_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
  x = sampling.sample_from_probs(draft_key, jnp.broadcast_to(q, (N, K, V)))
  # Half the rows propose all K guesses (so the bonus position is reached
  # often), the rest 0 .. K-1.
  num_proposed = jnp.minimum(jax.random.randint(jax.random.fold_in(key, 2), (N,), 0, 2 * K), K)
  keys = jax.random.split(verify_key, N)
  return p, p_raw, q, x, num_proposed, keys


@pytest.fixture(scope="module")
def mc():
  return _mc_problem()


def _per_position_tests(x, num_accepted, next_token, p):
  """Chi-square p-value and TV for the token at each position j of a round,
  over the rounds that reach it (num_accepted >= j). With position-wise fixed
  p_j and q_j that token is distributed as p_j: reaching j depends only on
  slots < j, independent of slot j's guess and uniforms."""
  x, n, nxt = map(np.asarray, (x, num_accepted, next_token))
  out = []
  for j in range(K + 1):
    reach = n >= j
    tok = np.where(n[reach] > j, x[reach, min(j, K - 1)], nxt[reach])
    counts = np.bincount(tok, minlength=V)
    res = ex.chi_square_test(counts, p[j])
    tv = ex.tv_distance(counts / counts.sum(), p[j])
    out.append((res.pvalue, tv, int(reach.sum())))
  return out


def test_problem_is_a_hard_one(mc):
  p, _, q, *_ = mc
  tv = ex.tv_distance(p[:K], q)
  assert np.all((tv > 0.3) & (tv < 0.6)), tv  # acceptance rates 0.5-0.7
  assert np.all((p == 0).sum(-1) == V - TARGET_CFG.top_k)


def test_chain_accept_emits_the_target_distribution(mc):
  p, _, q, x, num_proposed, keys = mc
  qb, pb = jnp.broadcast_to(q, (N, K, V)), jnp.broadcast_to(p, (N, K + 1, V))
  num_accepted, next_token = chain_accept(keys, x, qb, pb, num_proposed)
  results = _per_position_tests(x, num_accepted, next_token, p)
  pvalues = [r[0] for r in results]
  assert not np.any(ex.holm_bonferroni(pvalues, alpha=1e-3)), results
  assert pvalues[0] > 1e-3, results  # the first emitted token on its own
  for pvalue, tv, count in results:
    assert count > 10_000, results
    assert tv < ex.tv_noise_bound(V, count, confidence=0.999), results

  # A bonus token is sample_from_probs(p_n) with the row's DRAW_STREAM key.
  draw_keys = jax.vmap(lambda k: jax.random.fold_in(k, verify.DRAW_STREAM))(keys[:256])
  n = np.asarray(num_accepted)[:256]
  bonus = np.asarray(jax.vmap(sampling.sample_from_probs)(draw_keys, jnp.asarray(p[n])))
  is_bonus = n == np.asarray(num_proposed)[:256]
  assert is_bonus.sum() > 50
  np.testing.assert_array_equal(np.asarray(next_token)[:256][is_bonus], bonus[is_bonus])


def test_rows_depend_only_on_their_own_key(mc):
  p, _, q, x, num_proposed, keys = mc
  rows = np.array([5, 1, 7, 3, 0, 6, 2, 4])
  f = chain_accept
  args = lambda idx: (keys[idx], x[idx], jnp.broadcast_to(q, (8, K, V)),
                      jnp.broadcast_to(p, (8, K + 1, V)), num_proposed[idx])
  a = f(*args(np.arange(8)))
  b = f(*args(rows))
  np.testing.assert_array_equal(np.asarray(a[0])[rows], b[0])
  np.testing.assert_array_equal(np.asarray(a[1])[rows], b[1])


def _variant_rule(bug, p_raw):
  """chain_accept_with_uniforms with one deliberate bug (None: no bug)."""
  def rule(u_accept, u_draw, x, q, p, num_proposed):
    q_x = jnp.take_along_axis(q, x[..., None], -1)[..., 0]
    p_x = jnp.take_along_axis(p[:, :K], x[..., None], -1)[..., 0]
    ok = (u_accept < p_x) if bug == "ignore_q" else (u_accept * q_x < p_x)
    ok &= jnp.arange(K) < num_proposed[:, None]
    n = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1)
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
    q_n = jnp.take_along_axis(q, jnp.minimum(n, K - 1)[:, None, None], 1)[:, 0]
    base = jnp.asarray(p_raw)[n] if bug == "unprocessed_residual" else p_n
    residual = jnp.maximum(base - q_n, 0.0)
    mass = residual.sum(-1)
    rejected = n < num_proposed
    bonus = q_n if bug in ("bonus_from_q", "next_from_q") else p_n
    if bug == "next_from_q":
      residual = q_n
    elif bug == "residual_from_p":
      residual = p_n
    token = sampling.inverse_cdf(jnp.where(rejected[:, None], residual, bonus), u_draw)
    if bug == "unnormalised_residual":
      # Inverse CDF against the raw residual (u not scaled by its mass); a u
      # beyond the mass falls off the end and is redrawn from p.
      cdf = jnp.cumsum(residual, -1)
      in_residual = jnp.minimum(jnp.sum(cdf <= u_draw[:, None], -1), V - 1)
      from_p = sampling.inverse_cdf(p_n, (u_draw - mass) / (1 - mass))
      token = jnp.where(rejected, jnp.where(u_draw < mass, in_residual, from_p), token)
    return n, token
  return jax.jit(rule)


BUGS = ["unnormalised_residual", "ignore_q", "next_from_q", "bonus_from_q",
        "residual_from_p", "unprocessed_residual"]


def _run_variant(mc, bug):
  p, p_raw, q, x, num_proposed, keys = mc
  u_accept, u_draw = verify.chain_uniforms(keys, K)
  qb, pb = jnp.broadcast_to(q, (N, K, V)), jnp.broadcast_to(p, (N, K + 1, V))
  return _variant_rule(bug, p_raw)(u_accept, u_draw, x, qb, pb, num_proposed)


def test_variant_harness_without_bug_is_chain_accept(mc):
  p, _, q, x, num_proposed, keys = mc
  got = _run_variant(mc, None)
  want = chain_accept(keys, x, jnp.broadcast_to(q, (N, K, V)),
                             jnp.broadcast_to(p, (N, K + 1, V)), num_proposed)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("bug", BUGS)
def test_negative_controls_are_detected(mc, bug):
  p, _, _, x, _, _ = mc
  num_accepted, next_token = _run_variant(mc, bug)
  results = _per_position_tests(x, num_accepted, next_token, p)
  pvalues = np.array([r[0] for r in results])
  # Bonferroni over the K + 1 positions.
  assert pvalues.min() * (K + 1) < 1e-6, results
