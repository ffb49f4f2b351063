"""Several chain drafters verified as one tree (SpecInfer's multi-drafter token
tree, Miao et al. 2024, arXiv:2305.09781, Sections 3-4).

Each part drafts its own chain of up to k guesses from the same committed
history; the chains become the branches of one token tree, verified in the
loop's one tree forward (`verify.tree_greedy_accept` / `verify.tree_accept`).
A round then keeps the longer of the accepted runs, so drafters that are good
at different text add up: prompt lookup copies from the prompt (translation,
summarization, RAG), a learned head predicts what is not in it (math, open
questions). Named by joining the parts' names with '+' in the registry
('eagle3+prompt_lookup@k=3').

Layout. Chain g's guess i is node (g, i) of a depth-major candidate grid
(`trees.candidates_tree`); the valid nodes are then moved to the front in
their order (topological, siblings in part order), so a round where only
some parts propose verifies fewer tokens (`verify_widths`).

Exactness.
* Greedy (`merge`): the branches are merged into a trie (a guess equal to an earlier
  part's at the same place shares its node, its own continuation hanging
  below it); the greedy rule accepts the longest branch that matches the
  target's argmax, whatever drew it.
* Sampling: no merging. The branches stay apart, each node with the q its
  part drew it from. Part g draws with its own keys (fold_in(key, g) for
  g >= 1), so the parts' first guesses are independent draws, and the tree
  rule tests them in turn against the residual of the ones before --
  SpecInfer's multi-step speculative sampling, exact for independently drawn
  candidates each from its own q (a guess equal to an earlier, rejected one
  is rejected with certainty: the residual has no mass there). Merging a
  sampled guess into an equal earlier one would drop that candidate's own
  rejection step and change the residual: a union with `merge` whose parts
  sample is `lossy` (the exactness tests' negative control).

Size. The tree holds up to (number of parts) x k nodes, all verified in the
round's one forward. On the CPU that forward's cost steps at the
batch-invariant forward's tile (bfloat16: 5 rows), so two parts at k = 2
(root + 4 nodes) verify in one tile and at k = 3 in two: on SmolLM2 the k = 3
union accepted more (tau 2.08 against 1.93) and ran slower (0.97x against
1.32x over AR; experiments/results/README.md, headline, session 39).

Parts must be chain drafters that do not write into the target's cache
(layer skip and Lookahead run the target's own layers inside `propose`) and
that do not take the accepted tokens for their own guesses (a draft model
keeps its cache entries of accepted guesses: `Drafter.keeps_own_guesses`).
A part that learns from the verified path (EAGLE's features, Medusa's last
feature) must draft the union's k: it is handed the accepted path of the
tree, up to k tokens long, whichever part drafted it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax import trees
from specjax.drafters.base import Drafter, Proposal


def _learns_from_path(part: Drafter) -> bool:
  """Whether the part's state follows the verified path (its own `commit`)."""
  return type(part).commit is not Drafter.commit


def compact(tokens: jax.Array, parent: jax.Array, q: jax.Array
            ) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Move the tree's nodes (parent >= -1) to the front, in their order, parents
  renumbered; the rest become padding (parent -2). -> (tokens, parent, q,
  number of nodes (B,))."""
  b, n = tokens.shape
  valid = parent >= -1
  order = jnp.argsort(~valid, axis=1, stable=True)  # valid nodes first, in order
  new_index = jnp.cumsum(valid, axis=1) - 1  # old index -> new index (valid nodes)
  par = jnp.take_along_axis(parent, order, 1)
  par = jnp.where(par >= 0, jnp.take_along_axis(new_index, jnp.maximum(par, 0), 1), par)
  count = jnp.sum(valid, axis=1).astype(jnp.int32)
  par = jnp.where(jnp.arange(n)[None] < count[:, None], par, -2).astype(jnp.int32)
  return (jnp.take_along_axis(tokens, order, 1), par,
          jnp.take_along_axis(q, order[..., None], 1), count)


def chains_tree(cands: jax.Array, lengths: jax.Array, merge: bool
                ) -> Tuple[jax.Array, jax.Array]:
  """G chains per row (B, G, L) with valid lengths (B, G) -> one tree in the
  depth-major layout of `trees.candidates_tree` (node (g, i) at i * G + g):
  merged into a trie (`merge`), or every chain its own branch from the root."""
  if merge:
    return trees.candidates_tree(cands, lengths)
  b, g, l = cands.shape
  node = jnp.arange(l)[None, None, :] * g + jnp.arange(g)[None, :, None]  # (1, G, L)
  par = jnp.concatenate([jnp.full((1, g, 1), -1, jnp.int32), node[:, :, :-1]], axis=2)
  ok = jnp.arange(l)[None, None] < lengths[:, :, None]
  par = jnp.where(ok, jnp.broadcast_to(par, (b, g, l)), -2)
  flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, g * l)  # pylint: disable=unnecessary-lambda-assignment
  return flat(cands).astype(jnp.int32), flat(par).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Union(Drafter):
  """The parts' chains (each of k guesses at most) verified as one tree of
  depth k (module docstring). `params` is the tuple of the parts' params."""

  parts: Tuple[Drafter, ...] = ()
  # Merge the chains into a trie: exact for greedy targets (the registry sets
  # it from the target's sampling) or deterministic parts; with parts that
  # sample and a target that samples it is LOSSY (module docstring).
  merge: bool = True
  tree = True

  def __post_init__(self):
    super().__post_init__()
    if len(self.parts) < 2:
      raise ValueError(f"a union needs at least two drafters, got {len(self.parts)}")
    for p in self.parts:
      if p.tree:
        raise ValueError(f"{self.name}: {p.name} drafts a tree; a union joins chains")
      if type(p).propose is not Drafter.propose:
        raise ValueError(f"{self.name}: {p.name} writes into the target's cache while drafting "
                         "(self-speculative); a union joins drafters that do not")
      if p.keeps_own_guesses:
        raise ValueError(f"{self.name}: {p.name} keeps what it computed for its own guesses "
                         "and would take another part's accepted tokens for its own; a union "
                         "cannot hold it")
      if p.k > self.k or (_learns_from_path(p) and p.k != self.k):
        raise ValueError(f"{self.name}: {p.name} drafts k={p.k}; the union's depth is "
                         f"k={self.k} (parts that follow the verified path need exactly k)")

  @property
  def name(self) -> str:
    return "+".join(p.name for p in self.parts)

  @property
  def lossy(self) -> bool:
    samples = [not getattr(p, "sampling", sampling_lib.GREEDY).greedy for p in self.parts]
    return any(p.lossy for p in self.parts) or (self.merge and any(samples))

  @property
  def needs_prefill_hidden(self) -> bool:
    return any(p.needs_prefill_hidden for p in self.parts)

  def layers_for(self, target_cfg) -> tuple:
    for p in self.parts:
      if _learns_from_path(p):
        return p.layers_for(target_cfg)
    return ()

  @property
  def num_nodes(self) -> int:
    return len(self.parts) * self.k

  @property
  def verify_widths(self) -> tuple:
    # a round where only one part proposes verifies its chain alone
    return tuple(sorted({p.k + 1 for p in self.parts} | {self.num_nodes + 1}))

  @property
  def block(self) -> int:
    return max([self.num_nodes + 1] + [p.block for p in self.parts])

  def check(self, target_cfg, params) -> None:
    if not isinstance(params, tuple) or len(params) != len(self.parts):
      raise ValueError(f"{self.name}: params must be a tuple of {len(self.parts)} "
                       "(one per part)")
    for p, pp in zip(self.parts, params):
      p.check(target_cfg, pp)
    readers = {tuple(p.layers_for(target_cfg)) for p in self.parts if _learns_from_path(p)}
    if len(readers) > 1:
      raise ValueError(f"{self.name}: its parts read different layers of the target "
                       f"({sorted(readers)}); the verify forward returns one set")

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots: int,
           hidden=None) -> Any:
    return tuple(
        p.init(pp, target, prompt_tokens, prompt_lengths, num_slots,
               **({"hidden": hidden} if p.needs_prefill_hidden else {}))
        for p, pp in zip(self.parts, params))

  def draft(self, params, target, state, ctx, keys):
    props, states = [], []
    for g, (p, pp, s) in enumerate(zip(self.parts, params, state)):
      kg = keys if g == 0 else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, g)
      prop, s = p.draft(pp, target, s, ctx, kg)
      props.append(prop)
      states.append(s)
    k = self.k
    pad = lambda x: jnp.pad(  # guesses to k along axis 1 # pylint: disable=unnecessary-lambda-assignment
        x, [(0, k - x.shape[1]) if a == 1 else (0, 0) for a in range(x.ndim)])
    cands = jnp.stack([pad(pr.tokens) for pr in props], 1)  # (B, G, k)
    lengths = jnp.stack([jnp.minimum(pr.num_proposed, pr.tokens.shape[1]) for pr in props], 1)
    lengths = jnp.where(ctx.active[:, None], lengths, 0).astype(jnp.int32)
    tokens, parent = chains_tree(cands, lengths, merge=self.merge)
    q = jnp.stack([pad(pr.q) for pr in props], 1)  # (B, G, k, V)
    b, g_, _, v = q.shape
    q = jnp.swapaxes(q, 1, 2).reshape(b, k * g_, v)  # depth-major, as the nodes
    tokens, parent, q, count = compact(tokens, parent, q)
    return Proposal(tokens=tokens, q=q, num_proposed=count, parent=parent), tuple(states)

  def commit(self, params, state, ctx, verify) -> Any:
    return tuple(p.commit(pp, s, ctx, verify) for p, pp, s in zip(self.parts, params, state))
