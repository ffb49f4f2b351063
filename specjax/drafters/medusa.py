"""Medusa-1 heads (Cai et al. 2024, arXiv:2401.10774) and blockwise parallel
decoding (Stern et al. 2018, arXiv:1811.03115) on a frozen target.

Head i (i = 0 .. H-1) reads the target's final normed hidden state h_t at the
newest fed position -- the state whose LM-head output gives the next token
x_{t+1} -- and predicts the token i + 1 places beyond it, x_{t+2+i}:

    logits_i = LMHead_target(h_t + SiLU(W_i h_t + b_i))

The LM head is the target's own (frozen, not stored with the heads); W_i is
zero-initialised so an untrained head starts as the target's next-token
prediction. Parameters: {"w": (H, D, D) (out, in), "b": (H, D)}, and
optionally a reduced draft vocabulary as EAGLE's heads have it ("vocab":
(Vd,) token ids, "vocab_rank": every id, most frequent training answer token
first): the heads' logits cover only those ids (the target's LM-head rows,
gathered once by `prepare`), the guesses are drawn there and q is scattered
back into the full vocabulary, zero elsewhere -- exactly the distribution each
guess was drawn from, so verification stays exact.

Decoding (a chain of the first k heads): the verify forward returns the
hidden state at every fed position; after accepting n guesses the next token
was drawn from position n's logits, so h at position n is the feature for
the next round. Until the first verify there is no feature: the first round
proposes nothing (the loop then verifies one token, which yields it).

* `Medusa`: guess i is drawn from q_i = probs(logits_i, sampling) (argmax
  when greedy); q_i is exactly what the guess was drawn from, so chain
  rejection sampling keeps the target's distribution at any temperature.
* `Blockwise`: Stern et al.'s predict-verify-accept -- the heads' top-1 chain,
  a deterministic drafter (one-hot q). Under greedy verification this is the
  paper's algorithm; with a sampling target the one-hot rule keeps it exact.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import cut_at_eos, one_hot_q
from specjax.drafters.eagle import head_weights, prepare, with_draft_vocab  # noqa: F401
from specjax.models import transformer


def init_heads(key: jax.Array, num_heads: int, dim: int, dtype=jnp.float32) -> dict:
  """Zero-initialised residual heads (each starts as the identity)."""
  del key  # deterministic init; kept for a uniform init signature
  return {"w": jnp.zeros((num_heads, dim, dim), dtype), "b": jnp.zeros((num_heads, dim), dtype)}


def head_states(heads: dict, h: jax.Array, num: int | None = None) -> jax.Array:
  """h (..., D) -> (..., H, D): each head's residual block applied to h."""
  w, b = heads["w"], heads["b"]
  if num is not None:
    w, b = w[:num], b[:num]
  z = jnp.einsum("...d,hfd->...hf", h.astype(jnp.float32), w.astype(jnp.float32),
                 preferred_element_type=jnp.float32) + b.astype(jnp.float32)
  return h[..., None, :].astype(jnp.float32) + jax.nn.silu(z)


def head_logits(heads: dict, target_params, target_cfg, h: jax.Array,
                num: int | None = None, lm_w: jax.Array | None = None) -> jax.Array:
  """(..., D) -> (..., H, V) float32 logits through the target's LM head, or
  (..., H, Vd) over the heads' reduced draft vocabulary (its LM-head rows;
  `lm_w` passes them in, e.g. to a training step)."""
  states = head_states(heads, h, num)
  if lm_w is None and "vocab" not in heads:
    return transformer.lm_head(target_params, target_cfg, states)
  w = head_weights(heads, target_params, target_cfg) if lm_w is None else lm_w
  return transformer._dot(states, w)  # pylint: disable=protected-access


def to_full_vocab(heads: dict, tokens: jax.Array, q: jax.Array, vocab_size: int):
  """Guesses drawn over the reduced draft vocabulary (indices into it) and
  their q (..., Vd) -> token ids and q over the full vocabulary (zero off the
  draft vocabulary). A full-vocabulary head: unchanged."""
  if "vocab" not in heads:
    return tokens, q
  vocab = heads["vocab"]
  full = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., vocab].set(q)
  return vocab[tokens].astype(jnp.int32), full


@flax.struct.dataclass
class MedusaState:
  feature: jax.Array  # (B, D) target hidden at the newest fed position
  valid: jax.Array  # (B,) bool: a feature exists (false until the first verify)


@dataclasses.dataclass(frozen=True)
class Medusa(Drafter):
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  name = "medusa"

  def check(self, target_cfg, params) -> None:
    if params is None or "w" not in params:
      raise ValueError(f"{self.name}: needs trained heads (params with 'w' and 'b'); "
                       "load a checkpoint or train one with experiments/train.py")
    h, d, _ = params["w"].shape
    if d != target_cfg.dim:
      raise ValueError(f"{self.name}: heads of width {d} cannot read a target of width "
                       f"{target_cfg.dim}")
    if self.k > h:
      raise ValueError(f"{self.name}: k={self.k} needs {self.k} heads, the checkpoint has {h}")
    if "vocab" in params:
      v = params["vocab"]
      if v.ndim != 1:
        raise ValueError(f"{self.name}: the reduced vocabulary must be a 1-D array of token "
                         f"ids, got shape {tuple(v.shape)}")
      if int(jnp.max(v)) >= target_cfg.vocab_size or int(jnp.min(v)) < 0:
        raise ValueError(f"{self.name}: reduced vocabulary ids must lie in "
                         f"[0, {target_cfg.vocab_size})")

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots):
    b = prompt_tokens.shape[0]
    return MedusaState(feature=jnp.zeros((b, target.cfg.dim), jnp.float32),
                       valid=jnp.zeros((b,), bool))

  def _guesses(self, logits, keys):
    q = sampling_lib.probs(logits, self.sampling)  # (B, k, V)
    if self.sampling.greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), q
    sub = jax.vmap(lambda kk: jax.vmap(lambda i: jax.random.fold_in(kk, i))(
        jnp.arange(self.k)))(keys)  # (B, k) keys
    x = jax.vmap(jax.vmap(sampling_lib.sample_from_probs))(sub, q)
    return x.astype(jnp.int32), q

  def draft(self, params, target, state, ctx, keys):
    logits = head_logits(params, target.params, target.cfg, state.feature, self.k)  # (B, k, V|Vd)
    tokens, q = to_full_vocab(params, *self._guesses(logits, keys), target.cfg.vocab_size)
    num = jnp.where(state.valid & ctx.active, self.k, 0).astype(jnp.int32)
    num = cut_at_eos(tokens, num, target.cfg.eos_id)
    return Proposal(tokens=tokens, q=q, num_proposed=num), state

  def commit(self, params, state, ctx, verify):
    n = verify.num_accepted
    feat = jnp.take_along_axis(verify.hidden, n[:, None, None], axis=1)[:, 0]
    return MedusaState(feature=jnp.where(ctx.active[:, None], feat.astype(jnp.float32),
                                         state.feature),
                       valid=state.valid | ctx.active)


@dataclasses.dataclass(frozen=True)
class Blockwise(Medusa):
  """Blockwise parallel decoding: the heads' top-1 chain, one-hot q."""

  name = "blockwise"

  def _guesses(self, logits, keys):
    x = jnp.argmax(logits, -1).astype(jnp.int32)
    return x, one_hot_q(x, logits.shape[-1])


# ---- trees ------------------------------------------------------------------

# Exact: "wor", "iid", "topk". LOSSY (opt-in, for measuring it): "topk_q".
TREE_MODES = ("wor", "iid", "topk", "topk_q")


def _best_nodes(acc, budget: int) -> list:
  """[(acceptance probability, rank path)] of the `budget` most probable nodes,
  best first (see `tree_from_accuracies`)."""
  import heapq  # pylint: disable=import-outside-toplevel
  depth, ranks = len(acc), len(acc[0])
  heap = [(-float(acc[0][r]), (r,)) for r in range(ranks)]
  heapq.heapify(heap)
  out = []
  while heap and len(out) < budget:
    neg, node = heapq.heappop(heap)
    out.append((-neg, node))
    if len(node) < depth:
      for r in range(ranks):
        heapq.heappush(heap, (neg * float(acc[len(node)][r]), node + (r,)))
  return out


def tree_from_accuracies(acc, budget: int) -> tuple:
  """Medusa's sparse tree (Cai et al., Section 2.3.3): `acc[h][r]` is the
  probability that head h's rank-r token is the right one; a node (r_1 ..
  r_d) is accepted with probability prod_i acc[i][r_i] and contributes that
  much to the expected accepted length, so the best tree of `budget` nodes
  takes the `budget` most probable nodes (parents are always at least as
  probable as their children, so the set is a tree). -> choices, sorted."""
  return tuple(sorted((node for _, node in _best_nodes(acc, budget)),
                      key=lambda c: (len(c), c)))


def tree_node_values(acc, budget: int) -> list:
  """The acceptance probabilities of the nodes `tree_from_accuracies` picks,
  best first (their sum + 1 is the tree's expected tokens per round)."""
  return [v for v, _ in _best_nodes(acc, budget)]


def geometric_accuracies(top1, ranks: int):
  """A rank model from per-head top-1 accuracies: rank r is right with
  probability top1 * (1 - top1)^r (each rank missing independently)."""
  return [[float(a) * (1.0 - float(a)) ** r for r in range(ranks)] for a in top1]


def tree_structure(choices) -> tuple:
  """Static structure of a choice tree -> (parents, depths, ranks) in node
  order (by depth, then by rank path: topological, siblings by rank)."""
  choices = tuple(tuple(int(r) for r in c) for c in choices)
  if not choices or any(len(c) == 0 for c in choices):
    raise ValueError("a tree needs at least one node, each a non-empty tuple of ranks")
  order = sorted(set(choices), key=lambda c: (len(c), c))
  if len(order) != len(choices):
    raise ValueError("tree choices repeat a node")
  index = {c: i for i, c in enumerate(order)}
  parents = []
  for c in order:
    if len(c) > 1 and c[:-1] not in index:
      raise ValueError(f"tree node {c} has no parent {c[:-1]} in the choices")
    if min(c) < 0:
      raise ValueError(f"tree node {c}: ranks must be >= 0")
    parents.append(index[c[:-1]] if len(c) > 1 else -1)
  return tuple(parents), tuple(len(c) for c in order), tuple(c[-1] for c in order), tuple(order)


@dataclasses.dataclass(frozen=True)
class MedusaTree(Medusa):
  """Medusa heads drafting a static tree (`choices`: rank paths, e.g.
  ((0,), (1,), (0, 0)) = the top-2 of head 0 and the top-1 of head 1 under the
  first). The tokens of depth d come from head d - 1:

  * greedy target: the head's top-r tokens (rank r);
  * sampling, tree_mode "wor" (default, exact): a Gumbel-top-k draw from q, i.e.
    sampling without replacement, rank r the r-th draw; node q = q with the
    earlier ranks removed and renormalised;
  * "iid" (exact, SpecInfer): independent draws from q for each rank;
  * "topk": the head's top-r tokens as deterministic candidates (one-hot q).
    This is the fixed-top-k scheme of EAGLE-2's code ("q = 1": accept x with
    p_cur(x), on rejection zero it in p_cur and renormalise): exact, because
    a deterministic candidate's q IS one-hot.
  * "topk_q" (LOSSY, opt-in, `lossy` is True): the same top-r candidates
    tested with the head's q as if they had been sampled from it -- the
    mistake the fixed-top-k dispute is about; kept to measure how far off it
    is (tests/test_exactness_montecarlo.py reports its TV distance).

  One draw per depth is shared by every parent at that depth: a path visits
  one node per depth, so each node's children are still a draw from q in
  order, independent of what decided the path.
  """

  choices: tuple = ((0,),)
  tree_mode: str = "wor"
  tree = True
  name = "medusa_tree"

  def __post_init__(self):
    super().__post_init__()
    if not (isinstance(self.choices, tuple) and all(isinstance(c, tuple) for c in self.choices)):
      raise TypeError(f"{self.name}: choices must be a tuple of rank tuples (hashable: the "
                      f"drafter is a static jit argument), got {self.choices!r}")
    _, deps, _, _ = tree_structure(self.choices)  # (validates the tree; any node order)
    if self.k != max(deps):
      raise ValueError(f"{self.name}: k ({self.k}) must equal the tree's depth ({max(deps)})")
    if self.tree_mode not in TREE_MODES:
      raise ValueError(f"{self.name}: tree_mode must be one of {TREE_MODES}, "
                       f"got {self.tree_mode!r}")

  @property
  def num_nodes(self) -> int:
    return len(self.choices)

  def check(self, target_cfg, params) -> None:
    super().check(target_cfg, params)
    _, _, ranks, _ = self._structure()
    v = int(params["vocab"].shape[0]) if "vocab" in params else target_cfg.vocab_size
    if max(ranks) + 1 > v:
      raise ValueError(f"{self.name}: the tree asks for rank {max(ranks)} of a head, the draft "
                       f"vocabulary has {v} tokens; choose fewer tree_nodes or a larger "
                       "draft_vocab")

  @property
  def lossy(self) -> bool:
    return self.tree_mode == "topk_q"

  @property
  def block(self) -> int:
    return self.num_nodes + 1

  def _structure(self):
    return tree_structure(self.choices)

  def draft(self, params, target, state, ctx, keys):
    parents, deps, ranks, _ = self._structure()
    n = len(parents)
    b = state.feature.shape[0]
    # (B, D, V), or (B, D, Vd) over a reduced draft vocabulary: drawn there,
    # mapped to token ids at the end
    logits = head_logits(params, target.params, target.cfg, state.feature, self.k)
    v = logits.shape[-1]
    width = max(ranks) + 1
    q = sampling_lib.probs(logits, self.sampling)  # (B, D, V)
    if self.sampling.greedy or self.tree_mode in ("topk", "topk_q"):
      _, top = jax.lax.top_k(logits, width)  # (B, D, R)
      tok_dr = top.astype(jnp.int32)
      if self.tree_mode == "topk_q" and not self.sampling.greedy:  # LOSSY: q is not one-hot
        q_dr = jnp.broadcast_to(q[:, :, None], (b, self.k, width, v))
      else:
        q_dr = one_hot_q(tok_dr, v)
    elif self.tree_mode == "wor":
      sub = jax.vmap(lambda kk: jax.vmap(lambda i: jax.random.fold_in(kk, i))(
          jnp.arange(self.k)))(keys)  # (B, D)
      g = jax.vmap(jax.vmap(lambda kk: jax.random.gumbel(kk, (v,), jnp.float32)))(sub)
      score = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)) + g, -jnp.inf)
      _, tok_dr = jax.lax.top_k(score, width)
      tok_dr = tok_dr.astype(jnp.int32)
      from specjax import verify  # pylint: disable=import-outside-toplevel
      q_dr = verify.without_replacement(q, tok_dr)  # (B, D, R, V)
    else:  # iid
      sub = jax.vmap(lambda kk: jax.vmap(lambda i: jax.random.fold_in(kk, i))(
          jnp.arange(self.k * width)))(keys).reshape(b, self.k, width)
      tok_dr = jax.vmap(jax.vmap(jax.vmap(sampling_lib.sample_from_probs, in_axes=(0, None))))(
          sub, q).astype(jnp.int32)
      q_dr = jnp.broadcast_to(q[:, :, None], (b, self.k, width, v))
    d_idx = jnp.asarray([d - 1 for d in deps])
    r_idx = jnp.asarray(ranks)
    tokens, qn = to_full_vocab(params, tok_dr[:, d_idx, r_idx], q_dr[:, d_idx, r_idx],
                               target.cfg.vocab_size)  # (B, N), (B, N, V)
    num = jnp.where(state.valid & ctx.active, n, 0).astype(jnp.int32)
    parent = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    return Proposal(tokens=tokens, q=qn, num_proposed=num, parent=parent), state
