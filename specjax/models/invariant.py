"""A batch-invariant decode forward: every row's result is bit for bit the
same whatever block it is computed in.

`transformer.forward` picks XLA's fastest formulation for each shape: one
float32 row takes GEMV, 2-16 rows a fused multiply + reduction, more rows a
GEMM, and the attention einsums change shape with the block width. Each
rounds differently, so a (k + 1)-token verify block and k + 1 one-token AR
steps agree only up to ~1e-4 in float32 (more in bfloat16), and greedy
speculative decoding may pick the other of two near-tied tokens.

With `ModelConfig.batch_invariant`, decode-time forwards (AR steps, chain and
tree verification; prefill excluded, it is shared) run here instead:

* the B x T new tokens are flattened to rows and padded to whole tiles of
  `tile_rows(dtype, ModelConfig.invariant_tile)` rows (one tile size for
  every forward of a model: XLA CPU fuses a tile's softmax and SwiGLU with
  rounding that depends on the tile's row count, so a size chosen per block
  would break the invariance); every row-wise computation runs tile by tile in a
  loop whose trip count XLA cannot see (so one compiled body serves every width, and a
  one-tile block is not inlined and re-fused differently);
* every matmul has one formulation for its precision, applied to a whole
  (tile, D) tile (never GEMV or GEMM by row count); the weights are read once
  per tile;
* attention reads the cache in place: every query of a tile is scored
  against the caches of the few consecutive batch rows the tile's rows can
  belong to, in one product, keeping its own row's scores (a slot's score
  does not depend on where in the product it sits), then laid out in the
  query's view of the cache: the
  committed prefix at its own slots, then the block tokens it may see, in
  the order of their positions, at consecutive slots (a tree node sees its
  ancestors laid out by depth, exactly where one-token AR steps along that
  path would have put them); slots past that are masked. The softmax runs
  over the view. Weights x values is a fixed-chunk reduction (chunks of
  64 slots or the largest power of two dividing the cache, summed chunk
  after chunk): a chain's view is the cache itself, so every chunk is read in
  place; a tree node reads the few chunks that hold the block from its own
  view and every other chunk in place. With the same cache size (the loop
  sizes AR and speculative caches alike in this mode) each reduction sees
  the same values in the same places as AR does, and no query copies its
  row's cache (which cost more than the weights at long contexts).

Where `specjax.kernels` runs (the CPU, the kernels built; `formulation()` says
which form ran) the matmuls and the attention are its kernels, row-invariant by
construction: `rowdot` computes each tile's real rows only (the padding rows
cost no weight traffic) and `kernels.attention` scores each query over its view,
the visible slots only, in view order (its result depends neither on the cache's
size nor on the other rows). Only the element-wise parts (norms, RoPE, SwiGLU)
still run on the whole tile, so the tile's padding costs little: AR and verify
forwards cost what the default forward's do, or less (experiments/results/
invariance/, session 36).

Rows are computed symmetrically within a tile, so a row's result depends on
its own inputs only. Verified bit for bit in float32 and bfloat16 by
`tests/test_batch_invariant.py` (verify widths 1..17 and a tree against
one-token steps; a negative control without the setting).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from specjax import kernels
from specjax.models.cache import KVCache
from specjax.models import layers as L
from specjax.models.config import ModelConfig

# Rows per tile and the matmul's form, per weight dtype (measured on XLA CPU, SmolLM2's
# five matrix shapes, every matmul of one forward):
# - float32: 8 rows, multiply + reduction (29 ms a tile; a GEMM tile of 16 rows
#   costs 39 ms, the default's one-row GEMV 12-16 ms);
# - bfloat16: 5 rows, XLA's dot (a GEMM; a B = 1 verify block of k + 1 <= 5
#   rows in one tile). Session 27 on a 2-core AVX-512 EPYC, the modes
#   interleaved (experiments/results/invariance/cost_s27.md and the README
#   beside it): AR 0.98x the default bfloat16 forward's tok/s at 5 rows
#   against 0.67x at 16 (the earlier default, chosen on an AVX2 CPU: 23 ms a
#   16-row tile against the default's one-row 25 ms there), t_verify(5) 0.84x
#   against 1.24x; the 8-row multiply + reduction costs 31-34 ms and is lossy
#   above 8 rows.
# Each form gives every row of its tile the same bits wherever the row sits
# and whatever the other rows hold (tests/test_batch_invariant.py).
TILES = {jnp.dtype(jnp.float32): 8, jnp.dtype(jnp.bfloat16): 5}


# Which formulation of the invariant forward produced a result: the bits (and
# so a logged identity run) belong to it. Session 27: attention reads the cache
# in place, weights x values in fixed chunks, bfloat16 tiles of 5 rows (before:
# a per-query copy of the cache, bfloat16 tiles of 16). `formulation()` appends
# "+kernels" where specjax's kernels run (session 36: rowdot for the matmuls,
# kernels.attention for the attention).
FORMULATION = "s27-inplace-attention"


# Precisions whose decode forward is the batch-invariant one by default where the
# kernels run (`default_for`): session 36 (2-core AVX2 EPYC, the modes
# interleaved; experiments/results/invariance/cost_s36.md): bfloat16's invariant
# forward is the faster (AR 43.9 vs 40.1 tok/s, t_verify(5) 0.79x at B = 1,
# 0.61-0.75x after 512-1,280 tokens); float32's AR was 0.91x the default's (the
# goal: within 5%), so float32 keeps the default forward.
DEFAULT_ON = ("bfloat16",)


def default_for(dtype, mesh: bool = False) -> bool:
  """Whether a model loaded in `dtype` decodes batch-invariantly unless told
  otherwise: the precisions of DEFAULT_ON, where the kernels run (the CPU), off
  a device mesh (a model axis is out of the invariant forward's scope)."""
  return jnp.dtype(dtype).name in DEFAULT_ON and not mesh and _kernel()


def resolve(setting: Optional[bool], dtype, mesh: bool = False) -> bool:
  """A run's `batch_invariant` setting: itself when set, else `default_for`."""
  return default_for(dtype, mesh) if setting is None else bool(setting)


def tile_rows(dtype, tile: int = 0) -> int:
  """Rows per tile of the batch-invariant forward for weights of `dtype`:
  `tile` (`ModelConfig.invariant_tile`) when set, else the precision's default."""
  try:
    default = TILES[jnp.dtype(dtype)]
  except KeyError:
    raise ValueError(f"batch_invariant supports float32 and bfloat16 weights, not "
                     f"{jnp.dtype(dtype).name}") from None
  return int(tile) or default


def _tiled(f, *xs):
  """f over tiles: xs (n, tile, ...) -> stacked outputs, in a loop of n trips
  that XLA can neither unroll nor inline (the trip count passes an
  optimization barrier), so the body is one program for every n."""
  n = xs[0].shape[0]
  shapes = jax.eval_shape(f, *[x[0] for x in xs])
  outs = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape, s.dtype), shapes)
  trips = jax.lax.optimization_barrier(jnp.int32(n))

  def body(i, acc):
    y = f(*[jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs])
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), acc, y)

  return jax.lax.fori_loop(0, trips, body, outs)


def _kernel() -> bool:
  """Whether the matmuls and the attention take `specjax.kernels` (the CPU backend,
  the kernels built)."""
  return jax.default_backend() == "cpu" and kernels.available()


def formulation() -> str:
  """Which formulation of the invariant forward runs here (see FORMULATION)."""
  return FORMULATION + ("+kernels" if _kernel() else "")


def dot(x: jax.Array, w: jax.Array, valid: Optional[jax.Array] = None) -> jax.Array:
  """x (tile, D) @ w^T, w stored (F, D), float32 accumulation; x rounded to the
  weight dtype as the plain product does. Where `kernels.rowdot` runs (the CPU):
  the kernel, computing the tile's first `valid` rows only (its real rows; the
  padding rows' results are zero), every weight and precision alike. Else:
  bfloat16 XLA's dot (a GEMM over the tile), float32 the multiply + reduction
  form, over every row of the tile."""
  if _kernel():
    return kernels.rowdot(x.astype(w.dtype).astype(jnp.float32), w, valid)
  if w.dtype == jnp.bfloat16:
    return jnp.einsum("pd,fd->pf", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
  xf = x.astype(w.dtype).astype(jnp.float32)
  y = jnp.sum(w.astype(jnp.float32)[:, None, :] * xf[None, :, :], axis=-1)  # (F, tile)
  return y.T


def _views(length, positions, block_mask, num_slots: int):
  """Per query row (B, T): which cache slot each slot of its view reads, and
  whether it is visible. Slot s < length: itself. Slot length + r: the block
  token of rank r among those the query sees (ranked by position). -> (src
  (B, T, S) int32, None for a chain, whose view is the cache itself; visible
  (B, T, S) bool)."""
  b, t = positions.shape
  slots = jnp.arange(num_slots, dtype=jnp.int32)
  if block_mask is None:  # a chain: the view is the cache itself, causal
    visible = slots[None, None, :] <= length[:, None, None] + jnp.arange(t)[None, :, None]
    return None, visible
  block_mask = jnp.broadcast_to(block_mask, (b, t, t))
  earlier = positions[:, None, :] < positions[:, :, None]  # (B, Tj, Tm): pos m < pos j
  # rank[b, q, j]: visible block tokens of query q placed before token j
  rank = jnp.sum(block_mask[:, :, None, :] & earlier[:, None, :, :], axis=-1)  # (B, Tq, Tj)
  r = slots[None, None, :] - length[:, None, None]  # (B, 1, S)
  # which block token sits at view slot length + r
  hit = block_mask[:, :, None, :] & (rank[:, :, None, :] == r[..., None])  # (B, Tq, S, Tj)
  found = jnp.any(hit, axis=-1)
  j = jnp.argmax(hit, axis=-1).astype(jnp.int32)
  src = jnp.where(r < 0, slots[None, None, :], length[:, None, None] + j)
  visible = (r < 0) | found
  return jnp.clip(src, 0, num_slots - 1), visible


def forward(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            mask: Optional[jax.Array] = None, *, active: Optional[jax.Array] = None,
            layers: Optional[Sequence[int]] = None, hidden_layers: Sequence[int] = (),
            compute_logits: bool = True):
  """`transformer.forward`'s contract, computed batch-invariantly (see above)."""
  b, t = tokens.shape
  s = cache.num_slots
  length = cache.length
  rows = b * t
  tile = tile_rows(cfg.dtype, cfg.invariant_tile)
  n_tiles = -(-rows // tile)
  pad = n_tiles * tile - rows
  hq, hkv, dh, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
  scale = dh ** -0.5

  def tiles(x):  # (B, T, ...) -> (n, tile, ...)
    x = x.reshape((rows,) + x.shape[2:])
    x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape((n_tiles, tile) + x.shape[1:])

  def untile(x):  # (n, tile, ...) -> (B, T, ...)
    return x.reshape((n_tiles * tile,) + x.shape[2:])[:rows].reshape((b, t) + x.shape[2:])

  near = min(b, (tile - 1) // t + 2)  # batch rows a tile's rows can belong to
  chunk = next(c for c in (64, 32, 16, 8, 4, 2, 1) if s % c == 0)
  n_chunks = s // chunk
  win_chunks = min(-(-t // chunk) + 1, n_chunks)  # chunks that cover a tree block
  window = jnp.clip(length // chunk, 0, n_chunks - win_chunks)  # (B,) its first chunk
  src, visible = _views(length, positions, mask, s)
  row_of = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
  vis_t, row_t, pos_t = tiles(visible), tiles(row_of), tiles(positions)
  # each tile's real rows (the matmuls skip the padding where the kernel runs)
  valid_t = jnp.clip(rows - tile * jnp.arange(n_tiles, dtype=jnp.int32), 0, tile)
  view_t = () if mask is None else (tiles(src), tiles(jnp.broadcast_to(window[:, None], (b, t))))
  x = tiles(L.embed(params, tokens))  # (n, tile, D) float32
  run = tuple(range(cfg.num_layers) if layers is None else layers)
  if not run:
    raise ValueError("the batch-invariant forward needs at least one layer to run")
  head = params["embed"] if cfg.tie_embeddings else params["lm_head"]

  def qkv_tile(x, pos, nv, p):
    h = L.rms_norm(x, p["attn_norm"], cfg.norm_eps)
    qkv = dot(h, p["wqkv"], nv)
    q = qkv[:, :hq * dh].reshape(tile, 1, hq, dh)
    k = qkv[:, hq * dh:(hq + hkv) * dh].reshape(tile, 1, hkv, dh)
    v = qkv[:, (hq + hkv) * dh:].reshape(tile, 1, hkv, dh)
    q = L.rope(q, pos[:, None], cfg.rope_theta)[:, 0]
    k = L.rope(k, pos[:, None], cfg.rope_theta)[:, 0]
    return q, k, v[:, 0]

  def attn_mlp_tile(x, q, vis, row, nv, view, p, ck, cv):
    if _kernel():  # each query over its view, the visible slots only (kernels.attention)
      src = view[0] if view else jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (tile, s))
      o = kernels.attention(q.astype(ck.dtype).astype(jnp.float32), ck, cv, row, src, vis, nv,
                            scale)
      return mlp(x, o.reshape(tile, hq * dh), nv, p)
    # Scores against the caches of the batch rows the tile can hold, read in
    # place (never copied per query row), each query keeping its own row's: a
    # slot's score does not depend on where in the product it sits, nor on the
    # product's width (tests/test_batch_invariant.py)
    qg = q.reshape(tile, hkv, g, dh)
    # the tile's rows are consecutive rows of the B x T block: they belong to at
    # most `near` consecutive batch rows, from the first row's on (padding rows
    # clip to the last; their results are dropped)
    first = jnp.clip(row[0], 0, b - near)
    ck = jax.lax.dynamic_slice_in_dim(ck, first, near, axis=0)
    cv = jax.lax.dynamic_slice_in_dim(cv, first, near, axis=0)
    own = jnp.clip(row - first, 0, near - 1)
    sc = jnp.einsum("pgrd,bsgd->bpgrs", qg.astype(ck.dtype), ck,
                    preferred_element_type=jnp.float32) * scale
    sc = jnp.take_along_axis(sc, own[None, :, None, None, None], axis=0)[0]  # (tile, G, R, S)
    if view:  # a tree node: its scores laid out in its view (ancestors by depth)
      src, start = view
      sc = jnp.take_along_axis(sc, src[:, None, None, :], axis=-1)
    sc = jnp.where(vis[:, None, None, :], sc, -jnp.inf)
    w = jax.nn.softmax(sc, axis=-1).astype(cv.dtype)  # over the view's slots, in AR's order
    # weights x values in fixed chunks of `chunk` slots, summed chunk after chunk:
    # the products' reduction order depends on where a value sits in its chunk, so a
    # tree node reads the chunks that hold the block from its own view (its
    # ancestors where AR steps along its path put them), every other chunk in place
    wc = w.reshape(tile, hkv, g, n_chunks, chunk)
    o = jnp.einsum("pgrcs,bcsgd->bpgrcd", wc, cv.reshape(cv.shape[0], n_chunks, chunk, hkv, dh),
                   preferred_element_type=jnp.float32)
    o = jnp.take_along_axis(o, own[None, :, None, None, None, None], axis=0)[0]
    if view:
      span = jnp.arange(win_chunks * chunk, dtype=jnp.int32)
      at = start[:, None] * chunk + span  # (tile, win) view slots of the window
      w_win = jnp.take_along_axis(w, at[:, None, None, :], axis=-1)
      v_win = cv[own[:, None], jnp.take_along_axis(src, at, axis=-1)]  # (tile, win, G, Dh)
      o_win = jnp.einsum("pgrcs,bcsgd->bpgrcd", w_win.reshape(tile, hkv, g, win_chunks, chunk),
                         v_win.reshape(tile, win_chunks, chunk, hkv, dh),
                         preferred_element_type=jnp.float32)
      o_win = o_win[jnp.arange(tile), jnp.arange(tile)]  # each query with its own view
      rel = jnp.arange(n_chunks, dtype=jnp.int32)[None, :] - start[:, None]  # (tile, n)
      inside = (rel >= 0) & (rel < win_chunks)
      o_sel = jnp.take_along_axis(o_win, jnp.clip(rel, 0, win_chunks - 1)[:, None, None, :, None],
                                  axis=3)
      o = jnp.where(inside[:, None, None, :, None], o_sel, o)
    return mlp(x, jnp.sum(o, axis=3).reshape(tile, hq * dh), nv, p)

  def mlp(x, o, nv, p):  # the attention's output projection, then the MLP
    x = x + dot(o, p["wo"], nv)
    h = L.rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    gate, up = jnp.split(dot(h, p["w_gate_up"], nv), 2, axis=-1)
    return x + dot(jax.nn.silu(gate) * up, p["w_down"], nv)

  # One tile loop per layer: layer i's attention + MLP, then layer i + 1's
  # Q/K/V (or, after the last layer, the final norm and the LM head) in the same
  # body. Layer i + 1's K/V must reach the cache before its attention (a block's
  # later rows read its earlier rows, possibly in other tiles), so this is the
  # fewest loops: each costs a fixed overhead on XLA CPU.
  taps = {}
  new_k, new_v = list(cache.k), list(cache.v)
  q, k, v = _tiled(functools.partial(qkv_tile, p=params["layers"][run[0]]), x, pos_t, valid_t)
  for j, i in enumerate(run):
    new_k[i] = L.write_cache(cache.k[i], untile(k), length, active)
    new_v[i] = L.write_cache(cache.v[i], untile(v), length, active)
    last = j + 1 == len(run)

    def body(x, q, vis, row, pos, nv, *view, i=i, last=last, nxt=None if last else run[j + 1]):
      x = attn_mlp_tile(x, q, vis, row, nv, view, params["layers"][i], new_k[i], new_v[i])
      if not last:
        return (x,) + qkv_tile(x, pos, nv, params["layers"][nxt])
      final = L.rms_norm(x, params["final_norm"], cfg.norm_eps)
      return x, final, dot(final, head, nv) if compute_logits else None

    if last:
      x, final, logits = _tiled(body, x, q, vis_t, row_t, pos_t, valid_t, *view_t)
    else:
      x, q, k, v = _tiled(body, x, q, vis_t, row_t, pos_t, valid_t, *view_t)
    taps[i] = x

  taps[cfg.num_layers] = final
  if hidden_layers:
    hidden = jnp.concatenate([untile(taps[i]) for i in hidden_layers], axis=-1)
  else:
    hidden = untile(final)
  logits = untile(logits) if compute_logits else None
  step = jnp.full((b,), t, jnp.int32)
  if active is not None:
    step = jnp.where(active, step, 0)
  return logits, hidden, KVCache(k=tuple(new_k), v=tuple(new_v), length=length + step)
