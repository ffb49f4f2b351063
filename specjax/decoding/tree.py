"""Tree speculative decoding: a tree of candidates verified in ONE target forward.

Each round a tree drafter (`drafter.tree`) proposes, per row, up to N nodes
(`TreeProposal`): tokens, parents (-1 = the root, the newest committed token),
and each node's q (the distribution it was drawn from, given the siblings
drawn before it; see `specjax.verify`). The loop then

1. feeds [root, node 0, ..., node N-1] to the target at the row's cache
   offset, node j at RoPE position (length - 1) + depth(j), with an
   ancestor-only attention mask among the new tokens (`ancestor_mask`): every
   node sees the committed prefix, the root, and its own ancestors;
2. verifies the tree (`verify.tree_accept`, exact for any temperature;
   `verify.tree_greedy_accept` for greedy targets): an accepted path from the
   root and one more token;
3. commits: the accepted nodes' cache entries are gathered into the slots
   right after the root (`commit_path`), then the row's fill level is set as
   for a chain, so the cache holds exactly the committed prefix; the verify
   features of the root and the accepted path are handed to the drafter as a
   chain (`VerifyOutput.hidden[:, :n + 1]`).

Model-agnostic: flattening (topological node order), masks, depths and the
cache commit know nothing of the drafter that made the tree.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax import verify
from specjax.models import cache as cache_lib
from specjax.models import transformer


@flax.struct.dataclass
class TreeProposal:
  """Up to N nodes per row in topological order, siblings in draw order.

  Nodes at or beyond `num_nodes[b]` are padding: never accepted (their
  parent may be anything; they are masked out of every other node's view).
  A node with parent -2 inside the list is padding too (a duplicate that a
  trie merged away, or an empty candidate slot: `candidates_tree`).
  """

  tokens: jax.Array  # (B, N) int32
  parent: jax.Array  # (B, N) int32 in [-1, j - 1]; -2: not in the tree
  q: jax.Array  # (B, N, V) float32: node j was drawn from q[:, j]
  num_nodes: jax.Array  # (B,) int32

  @property
  def num_proposed(self) -> jax.Array:
    return self.num_nodes


def candidates_tree(cands: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """G candidate continuations per row as one trie (multi-draft verification
  of deterministic candidates: Lookahead's pool, n-gram matches).

  cands (B, G, L) tokens, lengths (B, G) in [0, L] (the candidate's valid
  prefix). Node (g, i) -- token cands[g, i] at depth i + 1 -- sits at index
  i * G + g (depth-major: parents come first); a candidate whose first i + 1
  tokens equal an earlier candidate's shares that candidate's nodes, and its
  own copies get parent -2 (not in the tree), as do positions past its length.
  Returns (tokens (B, G * L), parent (B, G * L)).
  """
  b, g, l = cands.shape
  same = jnp.cumprod(cands[:, :, None, :] == cands[:, None, :, :], axis=-1).astype(bool)
  ok = jnp.arange(l)[None, None] < lengths[:, :, None]  # (B, G, L)
  # the first candidate g' <= g with the same prefix through depth i (g itself if none earlier)
  canon = jnp.argmax(same & ok[:, None, :, :], axis=2)  # (B, G, L)
  own = ok & (canon == jnp.arange(g)[None, :, None])
  node = jnp.arange(l)[None, None, :] * g + canon  # index of (canon, i)
  par = jnp.concatenate([jnp.full((b, g, 1), -1, jnp.int32), node[:, :, :-1].astype(jnp.int32)],
                        axis=2)
  par = jnp.where(own, par, -2)
  flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, g * l)  # pylint: disable=unnecessary-lambda-assignment
  return flat(cands).astype(jnp.int32), flat(par)


def ancestor_mask(parent: jax.Array) -> jax.Array:
  """(B, N) parents -> (B, N + 1, N + 1) bool over [root, nodes]: entry [i, j]
  is true iff fed token j is fed token i or one of its ancestors."""
  b, n = parent.shape
  eye = jnp.eye(n + 1, dtype=bool)
  rows0 = jnp.broadcast_to(eye, (b, n + 1, n + 1))

  def step(rows, j):
    # fed index j + 1: itself + every ancestor of its parent (fed parent + 1)
    par = jnp.take_along_axis(rows, (parent[:, j] + 1)[:, None, None], axis=1)[:, 0]
    rows = rows.at[:, j + 1].set(par | eye[j + 1][None])
    return rows, None

  rows, _ = jax.lax.scan(step, rows0, jnp.arange(n))
  return rows


def depths(parent: jax.Array) -> jax.Array:
  """(B, N) parents -> (B, N) depth of each node (children of the root: 1)."""
  b, n = parent.shape

  def step(d, j):
    par = parent[:, j]
    dj = jnp.where(par < 0, 1, jnp.take_along_axis(d, jnp.maximum(par, 0)[:, None], 1)[:, 0] + 1)
    return d.at[:, j].set(dj), None

  d, _ = jax.lax.scan(step, jnp.zeros((b, n), jnp.int32), jnp.arange(n))
  return d


def commit_path(cache: cache_lib.KVCache, root_slot: jax.Array, path: jax.Array,
                num_accepted: jax.Array, active=None) -> cache_lib.KVCache:
  """Move the accepted nodes' entries into place: node path[i] was written at
  slot root_slot + 1 + path[i] by the verify forward; it belongs at
  root_slot + 1 + i. All entries are gathered before any is written (a
  node's index is never below its depth - 1, so sources never lie below
  their destinations). The fill level is left to the caller."""
  b, n = path.shape
  i = jnp.arange(n, dtype=jnp.int32)[None]
  take = i < num_accepted[:, None]
  if active is not None:
    take = take & active[:, None]
  src = root_slot[:, None] + 1 + jnp.where(take, path, i)
  dst = jnp.where(take, root_slot[:, None] + 1 + i, cache.num_slots)  # out of range: dropped
  rows = jnp.arange(b)[:, None]

  def move(arr):
    vals = arr[rows, jnp.clip(src, 0, arr.shape[1] - 1)]
    return arr.at[rows, dst].set(vals, mode="drop")

  return cache.replace(k=tuple(move(a) for a in cache.k), v=tuple(move(a) for a in cache.v))


def path_gather(x: jax.Array, path: jax.Array, width: int) -> jax.Array:
  """x (B, N + 1, ...) over [root, nodes] -> (B, width, ...) over [root, path
  nodes] (positions past the path repeat the root; they are never read)."""
  # fed index of node j is j + 1; path entries of -1 (past the path) map to the root
  idx = jnp.concatenate([jnp.zeros_like(path[:, :1]), path + 1], axis=1)[:, :width]
  if idx.shape[1] < width:
    idx = jnp.pad(idx, ((0, 0), (0, width - idx.shape[1])))
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def tree_round(params, cfg, drafter, draft_params, spec, state):
  """One draft-tree / verify / accept / commit round for every active row."""
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel

  depth_max = drafter.k  # the longest path a tree can hold
  active, accept_keys, prop, dstate, cache = sp.propose_round(params, cfg, drafter, draft_params,
                                                              spec, state)
  n_nodes = prop.tokens.shape[1]
  num_nodes = jnp.where(active, prop.num_nodes, 0)
  root_slot = state.length - 1
  cache = cache.with_length(root_slot)
  last = jnp.take_along_axis(state.history, root_slot[:, None], axis=1)
  fed = jnp.concatenate([last, prop.tokens], axis=1)  # (B, N + 1)
  valid = (jnp.arange(n_nodes)[None] < num_nodes[:, None]) & (prop.parent >= -1)
  parent = jnp.where(valid, prop.parent, -1)  # for positions and the mask
  dep = depths(parent)
  positions = root_slot[:, None] + jnp.concatenate([jnp.zeros_like(dep[:, :1]), dep], axis=1)
  mask = ancestor_mask(parent)
  # padding nodes: visible to nobody but themselves
  real = jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], axis=1)
  mask = mask & (real[:, None, :] | jnp.eye(n_nodes + 1, dtype=bool)[None])
  hidden_layers = tuple(drafter.layers_for(cfg))

  def verify_forward(cache, width):
    logits, hidden, cache = transformer.forward(
        params, cfg, fed[:, :width], positions[:, :width], cache,
        mask=mask[:, :width, :width], active=active, hidden_layers=hidden_layers)
    if width < n_nodes + 1:  # positions past every row's proposal are never read
      logits, hidden = (jnp.pad(x, ((0, 0), (0, n_nodes + 1 - width), (0, 0)), mode="edge")
                        for x in (logits, hidden))
    return logits, hidden, cache

  logits, hidden, cache, used = sp.run_verify(spec, num_nodes, verify_forward, cache,
                                              n_nodes + 1, drafter.verify_widths)
  if spec.rule != "exact":
    raise ValueError(f"tree verification supports the exact rule only, got {spec.rule!r}")
  parent = jnp.where(valid, parent, -2)  # padding is nobody's child
  if spec.sampling.greedy:
    path, n_acc, nxt = verify.tree_greedy_accept(prop.tokens, parent, logits, num_nodes)
  else:
    p = sampling_lib.probs(logits, spec.sampling)
    path, n_acc, nxt = verify.tree_accept(accept_keys, prop.tokens, parent, prop.q, p, num_nodes)
  n_acc = jnp.minimum(n_acc, depth_max)
  # the root's and the accepted path's logits chose this round's tokens
  state = sp.stop_nonfinite(state, path_gather(logits, path, depth_max + 1), n_acc + 1)
  cache = commit_path(cache, root_slot, path, n_acc, active)
  path_tokens = jnp.take_along_axis(prop.tokens, jnp.maximum(path[:, :depth_max], 0), axis=1)
  hidden_path = path_gather(hidden, path, depth_max + 1)
  evaluated = jnp.minimum(n_acc + 1, jnp.minimum(num_nodes, depth_max))
  return sp.commit_round(cfg, drafter, draft_params, state, dstate, cache, path_tokens, n_acc,
                         nxt, hidden_path, evaluated, used)
