"""Tree speculative decoding: the multi-draft acceptance rule on hand-made
distributions (exact for i.i.d., without-replacement and deterministic
siblings; two real bugs caught), tree masks and depths, the cache commit with
poisoned stale slots, and greedy identity of Medusa trees on a tiny target."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax import verify
from specjax.analysis import exactness
from specjax.analysis import montecarlo as mc
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax import trees as tree_lib
from specjax.drafters.medusa import (MedusaTree, geometric_accuracies, tree_from_accuracies,
                                     tree_structure)
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import tiny_config

FAMILY_ALPHA = 1e-3

# ---- the rule on hand-made distributions ---------------------------------------------
# V = 5 tokens. The target's first token ~ P0, its second ~ T[first]; the drafter's
# ~ Q0 and QT[first], far from the target's. Tree: three children of the root (drawn
# from Q0 by the mode), two children under the first of them (drawn from QT[x0]).
V = 5
P0 = np.array([0.40, 0.25, 0.20, 0.10, 0.05])
Q0 = np.array([0.05, 0.10, 0.15, 0.30, 0.40])
_rng = np.random.default_rng(4)
T = _rng.dirichlet(np.full(V, 0.7), size=V)
QT = _rng.dirichlet(np.full(V, 0.7), size=V)
PARENT = np.array([-1, -1, -1, 0, 0])
N_SAMPLES = 200_000


def _siblings(key, q, m, mode):
  """m siblings from q (V,) -> (tokens (m,), q of each (m, V))."""
  if mode == "iid":
    x = jax.vmap(lambda k: sampling_lib.sample_from_probs(k, q))(jax.random.split(key, m))
    return x, jnp.broadcast_to(q, (m, V))
  if mode in ("wor", "wor_fixed_q"):
    g = jax.random.gumbel(key, (V,))
    _, x = jax.lax.top_k(jnp.log(q) + g, m)
    qs = verify.without_replacement(q, x) if mode == "wor" else jnp.broadcast_to(q, (m, V))
    return x.astype(jnp.int32), qs
  _, x = jax.lax.top_k(q, m)  # "topk": deterministic candidates, one-hot q
  return x.astype(jnp.int32), jax.nn.one_hot(x, V)


@functools.partial(jax.jit, static_argnames=("mode", "no_residual"))
def _two_tokens(keys, mode, no_residual=False):
  """First two emitted tokens of one tree round (+ the next round's first draw
  when only one token came out), for each key."""
  p0, q0, t, qt = (jnp.asarray(a, jnp.float32) for a in (P0, Q0, T, QT))

  def one(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x_root, q_root = _siblings(k1, q0, 3, mode)
    x_sub, q_sub = _siblings(k2, qt[x_root[0]], 2, mode)
    tokens = jnp.concatenate([x_root, x_sub])
    q = jnp.concatenate([q_root, q_sub])
    uniform = jnp.full((V,), 1.0 / V)
    p = jnp.stack([p0, t[x_root[0]], t[x_root[1]], t[x_root[2]], uniform, uniform])
    return tokens, q, p, k3, k4

  tokens, q, p, k_acc, k_next = jax.vmap(one)(keys)
  b = tokens.shape[0]
  parent = jnp.broadcast_to(jnp.asarray(PARENT, jnp.int32), (b, 5))
  u, u_draw = verify.tree_uniforms(k_acc, 5)
  if no_residual:  # bug: a rejected sibling leaves p_cur as it was
    q = jnp.zeros_like(q).at[..., 0].set(1e-9) + 0 * q
  path, n, nxt = verify.tree_accept_with_uniforms(u, u_draw, tokens, parent, q, p,
                                                  jnp.full((b,), 5))
  ptok = jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1)
  y1 = jnp.where(n >= 1, ptok[:, 0], nxt)
  follow = jax.vmap(lambda k, y: sampling_lib.sample_from_probs(k, jnp.asarray(T, jnp.float32)[y])
                    )(k_next, y1)
  y2 = jnp.where(n >= 2, ptok[:, 1], jnp.where(n == 1, nxt, follow))
  return jnp.stack([y1, y2], 1), n


def _joint():
  return P0[:, None] * T


def _run(mode, **kw):
  keys = jax.random.split(jax.random.key(0), N_SAMPLES)
  samples, n = _two_tokens(keys, mode, **kw)
  return mc.joint_test(np.asarray(samples), _joint()), np.bincount(np.asarray(n), minlength=3)


@pytest.mark.parametrize("mode", ["wor", "iid", "topk"])
def test_tree_rule_is_exact_for_every_way_of_drawing_siblings(mode):
  result, accepted = _run(mode)
  assert result.pvalue > FAMILY_ALPHA, result
  assert result.tv < result.tv_bound, result
  assert accepted[1] > 0 and accepted[2] > 0, accepted  # both depths get accepted


def test_tree_rule_catches_a_fixed_q_for_siblings_drawn_without_replacement():
  """Negative control: siblings drawn without replacement but tested with the
  parent's q (the i.i.d. rule) -- a real bug the same test must reject."""
  result, _ = _run("wor_fixed_q")
  assert result.pvalue < 1e-6, result


def test_tree_rule_catches_a_missing_residual_update():
  """Negative control: after a rejected sibling p_cur is not replaced by the
  residual (q ~ 0 makes every test pass until the target says no)."""
  result, _ = _run("iid", no_residual=True)
  assert result.pvalue < 1e-6, result


def test_greedy_tree_rule_follows_the_argmax():
  tokens = jnp.asarray([[3, 1, 2, 4, 0]])
  parent = jnp.asarray([[-1, -1, 1, 1, 2]])
  logits = jnp.full((1, 6, V), -1.0)
  logits = logits.at[0, 0, 1].set(5.0)  # root: argmax 1 -> node 1 (not node 0 = 3)
  logits = logits.at[0, 2, 4].set(5.0)  # node 1: argmax 4 -> node 3
  logits = logits.at[0, 4, 2].set(5.0)  # node 3 (leaf): next token 2
  path, n, nxt = verify.tree_greedy_accept(tokens, parent, logits, jnp.asarray([5]))
  assert int(n[0]) == 2 and path[0, :2].tolist() == [1, 3] and int(nxt[0]) == 2
  path, n, nxt = verify.tree_greedy_accept(tokens, parent, logits, jnp.asarray([3]))
  assert int(n[0]) == 1 and int(nxt[0]) == 4  # node 3 is padding now


def test_without_replacement_q():
  q = jnp.asarray([0.5, 0.3, 0.2])
  qs = np.asarray(verify.without_replacement(q, jnp.asarray([1, 0, 2])))
  np.testing.assert_allclose(qs[0], [0.5, 0.3, 0.2], rtol=1e-6)
  np.testing.assert_allclose(qs[1], [0.5 / 0.7, 0.0, 0.2 / 0.7], rtol=1e-6)
  np.testing.assert_allclose(qs[2], [0.0, 0.0, 1.0], rtol=1e-6)


# ---- structure ---------------------------------------------------------------------

def test_ancestor_mask_and_depths():
  parent = jnp.asarray([[-1, -1, 0, 2, 1]])
  mask = np.asarray(tree_lib.ancestor_mask(parent))[0]
  # fed index i+1 = node i; fed 0 = root
  expect = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [0, 2, 5]}
  for i, anc in expect.items():
    assert np.nonzero(mask[i])[0].tolist() == anc, (i, mask[i])
  assert np.asarray(tree_lib.depths(parent))[0].tolist() == [1, 1, 2, 3, 2]


def test_tree_structure_and_sparse_tree():
  parents, deps, ranks, order = tree_structure([(0, 0), (1,), (0,)])
  assert order == ((0,), (1,), (0, 0)) and parents == (-1, -1, 0) and deps == (1, 1, 2)
  assert ranks == (0, 1, 0)
  with pytest.raises(ValueError, match="no parent"):
    tree_structure([(0,), (1, 0)])
  with pytest.raises(ValueError, match="repeat"):
    tree_structure([(0,), (0,)])
  acc = [[0.6, 0.2], [0.5, 0.1]]
  assert tree_from_accuracies(acc, 3) == ((0,), (1,), (0, 0))  # 0.6, 0.3, 0.2 ...
  assert tree_from_accuracies(acc, 1) == ((0,),)
  assert len(tree_from_accuracies(geometric_accuracies([0.5, 0.4], 3), 8)) == 8
  with pytest.raises(ValueError, match="must equal the tree's depth"):
    MedusaTree(k=3, choices=((0,), (0, 0)))


# ---- the cache commit with poisoned stale slots ---------------------------------------

CFG = tiny_config(vocab_size=64, dim=64, num_layers=2, eos_id=-1, max_seq_len=256)
PARAMS = transformer.init(jax.random.PRNGKey(7), CFG)


def test_commit_path_equals_token_by_token_decoding_with_poisoned_slots():
  """Verify a tree, accept a path, commit: the cache must then equal (on the
  committed prefix) the cache of feeding the path token by token, and the
  next step's logits must match -- with every slot past the fill level
  poisoned with large garbage beforehand, so reading a stale slot would show."""
  prefix = jnp.asarray([[5, 9, 3, 17, 4, 8]], jnp.int32)
  slots = 32
  cache = cache_lib.init_cache(CFG, 1, slots)
  pos = jnp.arange(6, dtype=jnp.int32)[None]
  _, _, cache = transformer.forward(PARAMS, CFG, prefix[:, :5], pos[:, :5], cache)
  # Finite garbage (NaN would leak through masked attention weights of 0 even
  # when nothing reads it): any stale slot that were read would show.
  junk = 50.0 * jax.random.normal(jax.random.PRNGKey(3), cache.k[0][:, 5:].shape)
  poison = lambda a: a.at[:, 5:].set(junk)  # pylint: disable=unnecessary-lambda-assignment
  cache = cache.replace(k=tuple(map(poison, cache.k)), v=tuple(map(poison, cache.v)))
  # tree over root = prefix[5]: nodes 0..5, accepted path = nodes 1 -> 3 -> 5
  tokens = jnp.asarray([[11, 21, 12, 22, 13, 23]], jnp.int32)
  parent = jnp.asarray([[-1, -1, 0, 1, 2, 3]], jnp.int32)
  fed = jnp.concatenate([prefix[:, 5:], tokens], 1)
  positions = 5 + jnp.concatenate([jnp.zeros((1, 1), jnp.int32), tree_lib.depths(parent)], 1)
  _, _, tcache = transformer.forward(PARAMS, CFG, fed, positions, cache,
                                     mask=tree_lib.ancestor_mask(parent))
  path = jnp.asarray([[1, 3, 5, -1, -1, -1]], jnp.int32)
  tcache = tree_lib.commit_path(tcache, jnp.asarray([5]), path, jnp.asarray([3]))
  tcache = tcache.with_length(jnp.asarray([9]))  # prefix (6) + path (3)
  # reference: the same tokens one by one
  seq = jnp.asarray([[5, 9, 3, 17, 4, 8, 21, 22, 23]], jnp.int32)
  rcache = cache_lib.init_cache(CFG, 1, slots)
  for i in range(9):
    _, _, rcache = transformer.forward(PARAMS, CFG, seq[:, i:i + 1], jnp.asarray([[i]]), rcache)
  for a, b in zip(tcache.k + tcache.v, rcache.k + rcache.v):
    np.testing.assert_allclose(np.asarray(a[:, :9]), np.asarray(b[:, :9]), rtol=1e-5, atol=1e-5)
  nxt = jnp.asarray([[30]], jnp.int32)
  la, _, _ = transformer.forward(PARAMS, CFG, nxt, jnp.asarray([[9]]), tcache)
  lb, _, _ = transformer.forward(PARAMS, CFG, nxt, jnp.asarray([[9]]), rcache)
  np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5, atol=1e-5)
  # negative control: without the commit the path's entries are in the wrong slots
  bad = transformer.forward(PARAMS, CFG, fed, positions, cache,
                            mask=tree_lib.ancestor_mask(parent))[2].with_length(jnp.asarray([9]))
  lc, _, _ = transformer.forward(PARAMS, CFG, nxt, jnp.asarray([[9]]), bad)
  assert np.abs(np.asarray(lc) - np.asarray(lb)).max() > 1e-2


def test_commit_path_moves_exactly_the_accepted_entries():
  """The in-place window commit against the slot-by-slot definition: several
  rows (one inactive), random paths and accepted counts, roots near the
  cache's end (destinations past its capacity dropped, sources never lost)."""
  rng = np.random.default_rng(0)
  b, slots, n = 4, 16, 5
  arrs = rng.normal(size=(2, b, slots, 2, 3)).astype(np.float32)
  cache = cache_lib.KVCache(k=(jnp.asarray(arrs[0]),), v=(jnp.asarray(arrs[1]),),
                            length=jnp.zeros((b,), jnp.int32))
  active = np.array([True, True, False, True])
  for trial in range(20):
    root = rng.integers(0, slots, size=b)
    root[0] = slots - 1 - trial % 4  # near and at the end
    num = rng.integers(0, n + 1, size=b)
    path = np.full((b, n), -1)
    for r in range(b):  # an increasing path: node indices >= depth - 1
      path[r, :num[r]] = np.sort(rng.choice(np.arange(n), size=num[r], replace=False))
    want = arrs.copy()
    for r in range(b):
      if not active[r]:
        continue
      for i in range(num[r]):
        src, dst = root[r] + 1 + path[r, i], root[r] + 1 + i
        if dst < slots:
          want[:, r, dst] = arrs[:, r, min(src, slots - 1)]
    got = tree_lib.commit_path(cache, jnp.asarray(root, jnp.int32), jnp.asarray(path, jnp.int32),
                               jnp.asarray(num, jnp.int32), jnp.asarray(active))
    np.testing.assert_array_equal(np.asarray(got.k[0]), want[0], err_msg=f"trial {trial}")
    np.testing.assert_array_equal(np.asarray(got.v[0]), want[1], err_msg=f"trial {trial}")


# ---- Medusa trees in the loop -------------------------------------------------------------

HEADS = {"w": 0.3 * jax.random.normal(jax.random.PRNGKey(1), (3, 64, 64)) / 8,
         "b": jnp.zeros((3, 64))}
CHOICES = tree_from_accuracies(geometric_accuracies([0.6, 0.4, 0.3], 3), 10)


def test_greedy_medusa_tree_equals_ar_and_accepts_more_than_the_chain():
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30]]
  ref = ar.generate(PARAMS, CFG, prompts, max_new_tokens=30).tokens
  tree = sp.generate(PARAMS, CFG, MedusaTree(k=3, choices=CHOICES), prompts, draft_params=HEADS,
                     max_new_tokens=30)
  assert tree.tokens == ref
  from specjax.drafters.medusa import Medusa  # pylint: disable=import-outside-toplevel
  chain = sp.generate(PARAMS, CFG, Medusa(k=3), prompts, draft_params=HEADS, max_new_tokens=30)
  assert chain.tokens == ref
  assert tree.stats["accepted"] >= chain.stats["accepted"], (tree.stats, chain.stats)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "spec"))
def _tree_round(params, cfg, drafter, dparams, spec, state):
  return sp.spec_round(params, cfg, drafter, dparams, spec, state)


@functools.partial(jax.jit, static_argnames=("cfg", "num_slots"))
def _prefill_cache(params, cfg, tokens, num_slots):
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return transformer.forward(params, cfg, tokens, pos, cache_lib.init_cache(cfg, b, num_slots),
                             compute_logits=False)[2]


def test_tree_rounds_leave_the_cache_of_the_committed_prefix():
  """In the loop: after each greedy tree round the target's cache holds the
  committed prefix exactly (a fresh prefill of it), with siblings listed
  best-last so that accepted nodes sit in other slots than their depths (the
  path must be moved into place: a stale slot would show)."""
  choices = tuple(sorted(CHOICES, key=lambda c: (len(c), tuple(-i for i in c))))
  assert choices != CHOICES
  drafter = MedusaTree(k=3, choices=choices)
  spec = sp.SpecConfig(sampling=sampling_lib.GREEDY)
  state = sp.start(PARAMS, CFG, drafter, [[5, 9, 3, 17, 4], [8, 8, 30]], draft_params=HEADS,
                   key=0, max_new_tokens=30, spec=spec)
  num_slots = state.cache.num_slots
  accepted = 0
  for i in range(4):
    before = np.asarray(state.length)
    state = _tree_round(PARAMS, CFG, drafter, HEADS, spec, state)
    length = np.asarray(state.length)
    accepted += int((length - before - 1).sum())
    cached = np.asarray(state.cache.length)
    np.testing.assert_array_equal(cached, length - 1)  # the newest token is fed next round
    fresh = _prefill_cache(PARAMS, CFG, state.history[:, :num_slots], num_slots)
    for a, b in zip(state.cache.k + state.cache.v, fresh.k + fresh.v):
      for row in range(2):
        np.testing.assert_allclose(np.asarray(a[row, :cached[row]]),
                                   np.asarray(b[row, :cached[row]]), rtol=1e-5, atol=1e-5,
                                   err_msg=f"round {i}, row {row}")
  assert accepted > 0  # paths were committed


def _eagle_head(fused, seed=9):
  from specjax.drafters.eagle import init_head, prepare  # pylint: disable=import-outside-toplevel
  head = init_head(jax.random.PRNGKey(seed), CFG, fused=fused,
                   vocab=jnp.arange(0, CFG.vocab_size, 2) if fused else None)
  head["fc"] = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1),
                                       (CFG.dim, 2 * CFG.dim)) / np.sqrt(2 * CFG.dim)
  return prepare(head, PARAMS, CFG)


@pytest.mark.parametrize("fused", [False, True], ids=["eagle", "eagle3-reduced"])
def test_greedy_eagle_tree_equals_ar(fused):
  from specjax.drafters.eagle import Eagle  # pylint: disable=import-outside-toplevel
  from specjax.drafters.eagle_tree import EagleTree  # pylint: disable=import-outside-toplevel
  head = _eagle_head(fused)
  prompts = [[5, 9, 3, 17, 4], [8, 8, 30], [2]]
  ref = ar.generate(PARAMS, CFG, prompts, max_new_tokens=24).tokens
  drafter = EagleTree(k=3, tree_topk=3, tree_width=2, tree_nodes=8, fused=fused)
  tree = sp.generate(PARAMS, CFG, drafter, prompts, draft_params=head, max_new_tokens=24)
  chain = sp.generate(PARAMS, CFG, Eagle(k=3, fused=fused), prompts, draft_params=head,
                      max_new_tokens=24)
  assert tree.tokens == ref and chain.tokens == ref
  assert tree.stats["accepted"] >= chain.stats["accepted"], (tree.stats, chain.stats)


def test_eagle_tree_settings_are_checked():
  from specjax.drafters.eagle_tree import EagleTree  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="cannot exceed tree_topk"):
    EagleTree(k=2, tree_topk=2, tree_width=3)
  with pytest.raises(ValueError, match="mode must be one of"):
    EagleTree(k=2, tree_mode="fixed")
  with pytest.raises(ValueError, match="tree_nodes must lie in"):
    EagleTree(k=2, tree_topk=2, tree_width=1, tree_nodes=9)
  # the exact sampled mode keeps every candidate: topk + (k - 1) width topk
  sampled = EagleTree(k=3, tree_topk=3, tree_width=2, tree_nodes=5, sampling=sampling_lib.SamplingConfig(1.0))
  assert sampled.num_nodes == 3 + 2 * 2 * 3
  assert EagleTree(k=3, tree_topk=3, tree_width=2, tree_nodes=5).num_nodes == 5  # greedy: reranked


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="_dot's multiply + reduction form is XLA CPU's; elsewhere it is a dot")
def test_eagle_tree_program_never_materialises_a_broadcast_head_weight():
  """An EAGLE-2 tree runs the head's products at one shape at every depth
  >= 1. Through `_dot`'s multiply + reduction form (2-16 rows), XLA CPU
  shared those products' broadcast weights and materialised each one as an
  (F, rows, D) array, rebuilt every round (75 MB for the 8,192-row draft LM
  head at 4 rows): a depth-4 tree drafted ~12x slower than a k = 2 chain.
  The tree's depths use one XLA dot per product (`eagle.shared_dot`); the
  compiled decode loop of an EAGLE-3 tree, on SmolLM2's matrix shapes with a
  reduced draft vocabulary, materialises no array of a head weight's shape
  widened by rows (in any order of the three dimensions).
  (Reverting the tree to `_dot` makes this fail on the jaxlib this was
  written on; timings are the benchmarks' job, not the suite's.)"""
  import re  # pylint: disable=import-outside-toplevel
  from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
  from specjax.drafters.eagle_tree import EagleTree  # pylint: disable=import-outside-toplevel
  from specjax.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(vocab_size=49152, dim=576, num_layers=1, num_heads=9, num_kv_heads=3,
                    head_dim=64, ffn_dim=1536, rope_theta=100000.0, max_seq_len=256)
  params = transformer.init(jax.random.key(0), cfg)
  head = eagle.prepare(eagle.init_head(jax.random.key(1), cfg, fused=True,
                                       vocab=jnp.arange(8192, dtype=jnp.int32)), params, cfg)
  drafter = EagleTree(k=3, tree_topk=4, tree_width=4, tree_nodes=4, fused=True)
  spec = sp.SpecConfig(sampling=sampling_lib.GREEDY)
  state = sp.start(params, cfg, drafter, [list(range(3, 40))], draft_params=head,
                   max_new_tokens=16, spec=spec)
  hlo = sp.decode.lower(params, cfg, drafter, head, state, spec=spec).compile().as_text()
  weights = {tuple(w.shape) for w in jax.tree.leaves(head) if w.ndim == 2}
  assert (8192, 576) in weights and (3072, 576) in weights  # LM rows, gate + up
  # arrays the program materialises: results of instructions outside fused
  # computations (the entry, loop bodies, ...); a fusion's inside never is
  blocks = re.split(r"\n(?=\S)", hlo)
  fused = set(re.findall(r"fusion\(.*?calls=(%[\w.\-]+)", hlo))
  names = [re.match(r"(ENTRY\s+)?(%[\w.\-]+)", block) for block in blocks]
  # the parse found the program's computations: the entry, fused ones, loop bodies
  assert any(n and n.group(1) for n in names) and fused, hlo[:2000]
  shapes = set()
  for block, name in zip(blocks, names):
    if name and name.group(2) not in fused:  # operands print without shapes
      shapes |= {tuple(int(n) for n in m) for m in re.findall(r"f32\[(\d+),(\d+),(\d+)\]", block)}
  assert shapes  # the checked computations hold 3-d arrays (the caches, at least)
  widened = sorted({s for s in shapes for w in weights  # a weight's two dims + rows > 1
                    if any(sorted(s[:i] + s[i + 1:]) == sorted(w) and s[i] > 1 for i in range(3))})
  assert not widened, f"materialised broadcast head weights: {widened}"
