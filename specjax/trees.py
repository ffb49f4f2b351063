"""Tree helpers for speculative decoding, pure functions over parent arrays.

A draft tree is flattened in topological order: per row, N nodes with
`parent` in [-1, j - 1] (-1: the root, the newest committed token; -2: not
in the tree). The verify forward feeds [root, node 0, ..., node N - 1]; these
helpers build its attention mask (`ancestor_mask`) and RoPE depths
(`depths`), merge deterministic candidates into a trie (`candidates_tree`),
and after acceptance move the accepted path's cache entries into place
(`commit_path`) and gather its outputs (`path_gather`). They know nothing of
the drafter that made the tree or of the loop that verifies it
(`specjax.decoding.speculative`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import cache as cache_lib


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
  root_slot + 1 + i. The fill level is left to the caller.

  Every source and destination lies in the N slots after the root, so each
  row reads that window once, permutes it (a gather over N slots) and writes
  it back in place (`dynamic_update_slice`): XLA CPU ran the general
  gather + scatter over every layer's cache at ~25 ms a round for one row
  (SmolLM2-135M, 30 layers), longer than the verify forward. Destinations
  past the cache's capacity are dropped (the window is clipped to the cache
  and the entries that would fall outside it stay where they are)."""
  b, n = path.shape
  s = cache.num_slots
  take = jnp.arange(n, dtype=jnp.int32)[None] < num_accepted[:, None]
  if active is not None:
    take = take & active[:, None]
  start = jnp.clip(root_slot + 1, 0, max(s - n, 0)).astype(jnp.int32)  # (B,) the window
  off = root_slot + 1 - start  # > 0 only where the window was clipped at the cache's end
  j = jnp.arange(n, dtype=jnp.int32)[None]
  rel = j - off[:, None]  # the path entry whose destination is window slot j
  relc = jnp.clip(rel, 0, n - 1)
  dest = (rel >= 0) & jnp.take_along_axis(take, relc, 1)
  src = jnp.where(dest, off[:, None] + jnp.take_along_axis(path, relc, 1), j)
  src = jnp.clip(src, 0, n - 1)  # window slot each window slot takes its entry from

  def move(arr):
    zeros = (0,) * (arr.ndim - 2)

    def row(r, arr):
      win = jax.lax.dynamic_slice(arr, (r, start[r]) + zeros, (1, n) + arr.shape[2:])
      return jax.lax.dynamic_update_slice(arr, jnp.take(win, src[r], axis=1),
                                          (r, start[r]) + zeros)

    return row(0, arr) if b == 1 else jax.lax.fori_loop(0, b, row, arr)

  return cache.replace(k=tuple(move(a) for a in cache.k), v=tuple(move(a) for a in cache.v))


def path_gather(x: jax.Array, path: jax.Array, width: int) -> jax.Array:
  """x (B, N + 1, ...) over [root, nodes] -> (B, width, ...) over [root, path
  nodes] (positions past the path repeat the root; they are never read)."""
  # fed index of node j is j + 1; path entries of -1 (past the path) map to the root
  idx = jnp.concatenate([jnp.zeros_like(path[:, :1]), path + 1], axis=1)[:, :width]
  if idx.shape[1] < width:
    idx = jnp.pad(idx, ((0, 0), (0, width - idx.shape[1])))
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
