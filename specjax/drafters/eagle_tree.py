"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv:2406.16858) on an EAGLE /
EAGLE-3 head (`specjax.drafters.eagle`: the head, its state and its chain).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Proposal
from specjax.drafters.eagle import Eagle, draft_logits, head_step, head_weights, shared_dot

# Exact: "wor", "topk". LOSSY (opt-in, for measuring it): "topk_q" (see MedusaTree).
EAGLE_TREE_MODES = ("wor", "topk", "topk_q")


@dataclasses.dataclass(frozen=True)
class EagleTree(Eagle):
  """EAGLE / EAGLE-3 head drafting a dynamic tree (EAGLE-2, Li et al. 2024,
  arXiv:2406.16858) of depth k.

  Depth 1: `tree_topk` children of the root from the head's output at the newest
  committed position. Each further depth expands the `tree_width` nodes of the
  previous depth with the highest cumulative confidence (the sum of the
  head's log-probabilities along the path, at T = 1): their pairs (the
  parent's head output, the node's token) go through the head in one step
  with tree attention (committed entries + the node's expanded ancestors),
  and each gets `tree_topk` children. All candidates: tree_topk + (k - 1)
  tree_width tree_topk.

  * Greedy targets, and tree_mode "topk" under sampling: children are the head's
    top tokens (deterministic candidates, one-hot q); the candidates are
    reranked by cumulative confidence to the `tree_nodes` best (EAGLE-2's rerank;
    a parent always ranks above its children).
  * tree_mode "wor" (default under sampling, exact): children are a Gumbel-top-k
    draw (without replacement) from the head's q under the target's sampling
    settings, node q the without-replacement q. Every drawn child is kept --
    a rerank would select children by their own values, which breaks
    exactness -- so the tree has all topk + (k - 1) width topk candidates and
    `tree_nodes` is ignored. Choosing which nodes to expand by their confidence is
    allowed: it decides a node's children before they are drawn.
  * tree_mode "topk_q" (LOSSY, opt-in): mode "topk"'s candidates tested with the
    head's q as if sampled from it (the mistake of the fixed-top-k dispute;
    "topk", EAGLE-2's "q = 1", is the exact form).
  """

  tree_topk: int = 4
  tree_width: int = 4
  tree_nodes: int = 16
  tree_mode: str = "wor"
  tree = True

  @property
  def name(self) -> str:
    return "eagle3_tree" if self.fused else "eagle_tree"

  def __post_init__(self):
    super().__post_init__()
    if self.tree_mode not in EAGLE_TREE_MODES:
      raise ValueError(f"{self.name}: tree_mode must be one of {EAGLE_TREE_MODES}, "
                       f"got {self.tree_mode!r}")
    if self.tree_topk < 1 or self.tree_width < 1:
      raise ValueError(f"{self.name}: need tree_topk >= 1 and tree_width >= 1")
    if self.tree_width > self.tree_topk:
      raise ValueError(f"{self.name}: tree_width ({self.tree_width}) cannot exceed tree_topk "
                       f"({self.tree_topk}): "
                       "depth 1 has only tree_topk nodes to expand")
    if not 1 <= self.num_nodes <= self.candidates:
      raise ValueError(f"{self.name}: tree_nodes must lie in [1, {self.candidates}] (the "
                       f"candidates of tree_topk={self.tree_topk}, tree_width={self.tree_width}, "
                       f"depth {self.k})")

  @property
  def candidates(self) -> int:
    return self.tree_topk + (self.k - 1) * self.tree_width * self.tree_topk

  @property
  def deterministic_tree(self) -> bool:
    return self.sampling.greedy or self.tree_mode in ("topk", "topk_q")

  @property
  def lossy(self) -> bool:
    return self.tree_mode == "topk_q"

  @property
  def num_nodes(self) -> int:
    """The verified tree's nodes: `tree_nodes` for deterministic candidates (reranked
    to that budget); a sampled tree keeps all its candidates."""
    return self.tree_nodes if self.deterministic_tree else self.candidates

  @property
  def block(self) -> int:
    # verify: nodes + 1; the head: its pending pairs (k + 1) + the fed frontier
    return max(self.num_nodes + 1, self.k + 1 + (self.k - 1) * self.tree_width + 1)

  def _children(self, logits, q_sub, key, vocab, vocab_size):
    """Children of P parents of one row: logits (P, Vd) -> tokens (P, K) ids,
    q (P, K, V) (None for deterministic candidates), log-confidence (P, K)."""
    kk = self.tree_topk
    logconf = jax.nn.log_softmax(logits, -1)
    if self.deterministic_tree:
      conf, j = jax.lax.top_k(logconf, kk)
      q = None
      if self.tree_mode == "topk_q" and not self.sampling.greedy:  # LOSSY: the parent's q
        q = jnp.broadcast_to(q_sub[:, None], (q_sub.shape[0], kk, q_sub.shape[-1]))
        if vocab is not None:
          q = jnp.zeros(q.shape[:-1] + (vocab_size,), jnp.float32).at[..., vocab].set(q)
    else:
      g = jax.random.gumbel(key, logits.shape, jnp.float32)  # one row: (P, Vd)
      score = jnp.where(q_sub > 0, jnp.log(jnp.maximum(q_sub, 1e-38)) + g, -jnp.inf)
      _, j = jax.lax.top_k(score, kk)
      conf = jnp.take_along_axis(logconf, j, -1)
      from specjax import verify as verify_lib  # pylint: disable=import-outside-toplevel
      q = verify_lib.without_replacement(q_sub, j)  # (B, P, K, Vd)
      if vocab is not None:
        q = jnp.zeros(q.shape[:-1] + (vocab_size,), jnp.float32).at[..., vocab].set(q)
    ids = j.astype(jnp.int32) if vocab is None else vocab[j]
    return ids, q, conf

  def draft(self, params, target, state, ctx, keys):
    cfg = target.cfg
    vsize = cfg.vocab_size
    vocab = params.get("vocab")
    b = ctx.length.shape[0]
    kk, w, depth = self.tree_topk, self.tree_width, self.k
    cache, base, a_last = self.catch_up(params, target, state, ctx)
    lm_w = head_weights(params, target.params, cfg)
    dkeys = jax.vmap(lambda key: jax.random.split(key, depth))(keys)  # (B, depth)

    def draw(a, d):  # head outputs (B, P, D) -> children of those P parents
      # depths >= 1 read the head's weights once per depth: one XLA dot each
      # (`shared_dot`); depth 0 is the chain's first draft, as the chain computes it
      logits = (draft_logits(params, target.params, cfg, a, lm_w, dot=shared_dot) if d else
                draft_logits(params, target.params, cfg, a, lm_w))
      q_sub = sampling_lib.probs(logits, self.sampling)
      return jax.vmap(lambda lg, qs, k_: self._children(lg, qs, k_, vocab, vsize))(
          logits, q_sub, dkeys[:, d])

    tok, q, conf = draw(a_last[:, None], 0)  # (B, 1, K)
    tokens = [tok.reshape(b, kk)]
    qs = [None if q is None else q.reshape(b, kk, vsize)]
    scores = [conf.reshape(b, kk)]
    parents = [jnp.full((b, kk), -1, jnp.int32)]
    a_of = [jnp.broadcast_to(a_last[:, None], (b, kk, a_last.shape[-1]))]  # parent's output
    start = [0]  # node index of each depth's first node
    n_fed = (depth - 1) * w
    anc = jnp.zeros((b, max(n_fed, 1), max(n_fed, 1)), bool)  # among fed entries
    entry_prev = None  # (B, W): fed entry of each frontier node of the last depth
    slots = cache.num_slots
    for d in range(1, depth):
      # the frontier: the w most confident nodes of depth d
      _, sel = jax.lax.top_k(scores[-1], w)  # (B, W) indices within depth d's block
      f_tok = jnp.take_along_axis(tokens[-1], sel, 1)
      f_a = jnp.take_along_axis(a_of[-1], sel[..., None], 1)
      f_score = jnp.take_along_axis(scores[-1], sel, 1)
      e0 = (d - 1) * w
      eid = e0 + jnp.arange(w)
      if d == 1:
        rows = jax.nn.one_hot(eid, n_fed, dtype=bool)[None].repeat(b, 0)  # (B, W, E)
      else:
        par_local = jnp.take_along_axis(parents[-1], sel, 1) - start[-2]  # index in depth d-1
        # the parent was fed iff it was in the previous frontier
        par_entry = jnp.take_along_axis(entry_prev, jnp.clip(par_local, 0, entry_prev.shape[1] - 1),
                                        1)
        rows = (jnp.take_along_axis(anc, par_entry[..., None], 1)
                | jax.nn.one_hot(eid, n_fed, dtype=bool)[None])
      anc = anc.at[:, e0:e0 + w].set(rows)
      # entries of the frontier of depth d, by node index within its block
      nd = tokens[-1].shape[1]
      entry_now = jnp.full((b, nd), -1, jnp.int32).at[jnp.arange(b)[:, None], sel].set(eid)
      rel = jnp.arange(slots)[None, None, :] - base[:, None, None]
      vis = jnp.take_along_axis(rows, jnp.clip(rel, 0, n_fed - 1).repeat(w, 1), 2)
      allowed = (rel < 0) | ((rel >= 0) & (rel < e0 + w) & vis)
      pos = jnp.broadcast_to((base + d - 1)[:, None], (b, w))
      c = cache.with_length(base + e0)
      a_new, fed = head_step(params, target.params, cfg, f_a, f_tok, pos, c, active=ctx.active,
                             allowed=allowed, dot=shared_dot)
      cache = cache.replace(k=fed.k, v=fed.v)  # the fill level stays at base
      tok, q, conf = draw(a_new, d)  # (B, W, K)
      sel_nodes = start[-1] + sel  # global node index of each frontier node
      tokens.append(tok.reshape(b, w * kk))
      qs.append(None if q is None else q.reshape(b, w * kk, vsize))
      scores.append((f_score[..., None] + conf).reshape(b, w * kk))
      parents.append(jnp.repeat(sel_nodes, kk, axis=1).astype(jnp.int32))
      a_of.append(jnp.repeat(a_new, kk, axis=1))
      start.append(start[-1] + nd)
      entry_prev = entry_now
    tokens = jnp.concatenate(tokens, 1)
    parent = jnp.concatenate(parents, 1)
    score = jnp.concatenate(scores, 1)
    total = tokens.shape[1]
    q = None if qs[0] is None else jnp.concatenate(qs, 1)
    if self.num_nodes < total:  # rerank (deterministic trees only): the most confident nodes
      dep = jnp.concatenate([jnp.full((x.shape[1],), i + 1) for i, x in enumerate(scores)])
      key_ = score - 1e-4 * dep[None]  # ties: parents first
      _, keep = jax.lax.top_k(key_, self.num_nodes)
      keep = jnp.sort(keep, axis=1)  # node order (topological, siblings in rank order)
      new_index = jnp.cumsum(jnp.zeros((b, total), jnp.int32).at[
          jnp.arange(b)[:, None], keep].set(1), axis=1) - 1
      par = jnp.take_along_axis(parent, keep, 1)
      parent = jnp.where(par < 0, -1, jnp.take_along_axis(new_index, jnp.maximum(par, 0), 1))
      tokens = jnp.take_along_axis(tokens, keep, 1)
      if q is not None:
        q = jnp.take_along_axis(q, keep[..., None], 1)
    if q is None:  # deterministic candidates: one-hot q, of the kept nodes only
      q = jax.nn.one_hot(tokens, vsize, dtype=jnp.float32)
    num = jnp.where(ctx.active, self.num_nodes, 0).astype(jnp.int32)
    return (Proposal(tokens=tokens, q=q, num_proposed=num, parent=parent),
            state.replace(cache=cache.with_length(base), base=base))
