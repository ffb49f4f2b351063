"""A pure-functional Llama-family decoder: `init` and `forward` over a params pytree.

Params layout (D width, F ffn, H heads, G kv heads, Dh head dim, V vocab):

  embed            (V, D)
  layers[l]        attn_norm (D,), wqkv ((H + 2G) Dh, D), wo (D, H Dh),
                   mlp_norm (D,), w_gate_up (2F, D), w_down (D, F)
  final_norm       (D,)
  lm_head          (V, D)        only when the embedding is not tied

Matrices are stored (out, in), as torch's nn.Linear and GGUF store them: XLA
CPU runs x @ W^T with W row-major (out, in) ~8% faster for one token and ~25%
faster for the 4-8 token blocks of verification than x @ W with W (in, out)
(measured on the 2-core dev machine). Q/K/V and gate/up are stored fused on
the output axis: on CPU one wide matmul beats three narrow ones. The layers are a Python list and the layer loop is unrolled: XLA CPU runs
per-layer arrays 2-3x faster than `lax.scan` over stacked weights.

RoPE uses the HF "rotate half" layout (GGUF's interleaved Q/K rows are permuted
back at load time).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from specjax import kernels
from specjax.models import invariant as invariant_lib
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layers import embed, rms_norm, rope  # pylint: disable=unused-import
from specjax.models.layers import write_cache as _write

Params = dict


def init(key: jax.Array, cfg: ModelConfig) -> Params:
  """Random parameters (scaled normal), in `cfg.dtype`."""
  d, f, dh = cfg.dim, cfg.ffn_dim, cfg.head_dim
  qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * dh
  dt = cfg.jnp_dtype
  k_embed, k_head, *k_layers = jax.random.split(key, 2 + cfg.num_layers)

  def normal(k, shape, fan_in):
    return (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dt)

  layers = []
  for kl in k_layers:
    k1, k2, k3, k4 = jax.random.split(kl, 4)
    layers.append(dict(
        attn_norm=jnp.ones((d,), dt),
        wqkv=normal(k1, (qkv, d), d),
        wo=normal(k2, (d, cfg.num_heads * dh), cfg.num_heads * dh),
        mlp_norm=jnp.ones((d,), dt),
        w_gate_up=normal(k3, (2 * f, d), d),
        w_down=normal(k4, (d, f), f),
    ))
  params = dict(embed=normal(k_embed, (cfg.vocab_size, d), 1.0), layers=layers,
                final_norm=jnp.ones((d,), dt))
  if not cfg.tie_embeddings:
    params["lm_head"] = normal(k_head, (cfg.vocab_size, d), d)
  return params


# Row counts (batch x new tokens) up to this run as a few-row product instead
# of a GEMM, and only for weights this large (bandwidth-bound products; the
# test suite's small models, often vmapped over 10^5 keys, keep the plain
# product). Large blocks (prefill) keep the GEMM.
SMALL_ROWS_MAX = 16
SMALL_ROWS_MIN_WEIGHT = 1 << 18


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w^T for w stored (out, in), with float32 accumulation and output
  (bf16-output matmuls are slow on CPU); x is rounded to the weight dtype.

  On the CPU, 1-16 rows times a large weight take `kernels.rowdot`, which
  reads the weights once for all rows (XLA CPU has no such kernel: a 5-row
  product costs 2x its one-row GEMV) and gives each row the same bits
  whatever the row count. Otherwise (the kernel unavailable):
  one float32 row takes XLA's GEMV; 2-16 float32 rows (bfloat16: 1-8, padded
  to at least 2: every one-row bfloat16 product form takes a slow path, ~7x,
  and XLA CPU lowers the 16-row bfloat16 reduction to a lossy kernel, ~0.5%
  error) a fused multiply + reduction, padded to a power of two (5-7 rows run
  slower than 8)."""
  rows = 1
  for n in x.shape[:-1]:
    rows *= n
  big = w.size >= SMALL_ROWS_MIN_WEIGHT and jax.default_backend() == "cpu"
  if big and rows <= kernels.MAX_ROWS and kernels.available():
    xf = x.reshape(rows, x.shape[-1]).astype(w.dtype).astype(jnp.float32)
    return kernels.rowdot(xf, w).reshape(*x.shape[:-1], w.shape[0])
  max_rows = SMALL_ROWS_MAX if w.dtype == jnp.float32 else 8
  if big and rows <= max_rows and not (rows == 1 and w.dtype == jnp.float32):
    padded = max(2, 1 << (rows - 1).bit_length())
    xf = x.reshape(rows, x.shape[-1]).astype(w.dtype).astype(jnp.float32)
    xf = jnp.pad(xf, ((0, padded - rows), (0, 0)))
    y = jnp.sum(w.astype(jnp.float32)[:, None, :] * xf[None, :, :], axis=-1)  # (F, padded)
    return y.T[:rows].reshape(*x.shape[:-1], w.shape[0])
  return jnp.einsum("...d,fd->...f", x.astype(w.dtype), w,
                    preferred_element_type=jnp.float32)


def attention_mask(length: jax.Array, num_new: int, num_slots: int,
                   mask: Optional[jax.Array] = None) -> jax.Array:
  """Which cache slots each new token may attend to: (B, T, S) bool.

  Slots below the row's fill level `length[b]` (the committed prefix) are
  visible to every new token. The T new tokens occupy slots
  `length[b] .. length[b] + T - 1`; among them token t sees token j iff
  `mask[b, t, j]` (default: causal, j <= t; a tree passes ancestor-only).
  Everything else -- stale slots from rejected guesses, unused capacity -- is
  hidden.
  """
  slots = jnp.arange(num_slots, dtype=jnp.int32)
  rel = slots[None, None, :] - length[:, None, None]  # (B, 1, S)
  t = jnp.arange(num_new, dtype=jnp.int32)[None, :, None]  # (1, T, 1)
  in_new = (rel >= 0) & (rel < num_new)
  if mask is None:
    new_ok = rel <= t
  else:
    mask = jnp.broadcast_to(mask, (length.shape[0], num_new, num_new))
    idx = jnp.clip(rel, 0, num_new - 1)
    new_ok = jnp.take_along_axis(mask, jnp.broadcast_to(idx, (mask.shape[0], num_new, num_slots)),
                                 axis=2)
  return (rel < 0) | (in_new & new_ok)


def _attention(q, k, v, allowed, cfg: ModelConfig):
  """q: (B, T, H, Dh); k, v: (B, S, G, Dh); allowed: (B, T, S) -> (B, T, H*Dh)."""
  b, t = q.shape[:2]
  q = q.reshape(b, t, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
  scores = jnp.einsum("btgrd,bsgd->bgrts", q.astype(k.dtype), k,
                      preferred_element_type=jnp.float32)
  scores = scores * (cfg.head_dim ** -0.5)
  scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrts,bsgd->btgrd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, cfg.num_heads * cfg.head_dim)


def lm_head(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
  """Final-normed hidden (..., D) -> float32 logits (..., V)."""
  return _dot(h, params["embed"] if cfg.tie_embeddings else params["lm_head"])


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: Optional[jax.Array] = None,
    *,
    active: Optional[jax.Array] = None,
    layers: Optional[Sequence[int]] = None,
    hidden_layers: Sequence[int] = (),
    compute_logits: bool = True,
    batch_invariant: Optional[bool] = None,
) -> Tuple[Optional[jax.Array], jax.Array, KVCache]:
  """Run T new tokens per row against the cache.

  Args:
    params: parameter pytree (see module docstring).
    cfg: static model config.
    tokens: (B, T) int token ids.
    positions: (B, T) int RoPE positions (for a chain, `cache.length[:, None] +
      arange(T)`; for a tree, the prefix length plus each node's depth).
    cache: the KV cache; the new tokens are written to slots
      `cache.length[b] + t` of row b.
    mask: optional (B, T, T) or (T, T) bool, which new tokens each new token
      attends to (default causal). Tree verification passes ancestor-only.
    active: optional (B,) bool; inactive rows (finished requests) write nothing
      and keep their fill level.
    layers: static subset of layer indices to run (self-speculative layer
      skipping); default all. Skipped layers write nothing to the cache.
    hidden_layers: static; which hidden states to return. Empty: the final
      normed hidden state (B, T, D). Otherwise the outputs of those layers
      (index `num_layers` meaning the final normed state), concatenated on the
      last axis: (B, T, len(hidden_layers) * D).
    compute_logits: static; skip the LM head (feature extraction for training).
    batch_invariant: static; run the batch-invariant formulation
      (`specjax.models.invariant`: each row's result bit for bit independent
      of the block it is in). Default `cfg.batch_invariant`; prefill passes
      False (it is shared by AR and speculative runs, and long).

  Returns:
    (logits (B, T, V) float32 or None, hidden, new cache with length advanced
    by T on active rows).
  """
  if cfg.batch_invariant if batch_invariant is None else batch_invariant:
    return invariant_lib.forward(params, cfg, tokens, positions, cache, mask, active=active,
                                 layers=layers, hidden_layers=hidden_layers,
                                 compute_logits=compute_logits)
  b, t = tokens.shape
  length = cache.length
  allowed = attention_mask(length, t, cache.num_slots, mask)
  run = range(cfg.num_layers) if layers is None else tuple(layers)
  x = embed(params, tokens)
  taps = {}
  new_k, new_v = list(cache.k), list(cache.v)
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  for i in run:
    p = params["layers"][i]
    h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
    qkv = _dot(h, p["wqkv"])
    q = qkv[..., : hq * dh].reshape(b, t, hq, dh)
    k = qkv[..., hq * dh:(hq + hkv) * dh].reshape(b, t, hkv, dh)
    v = qkv[..., (hq + hkv) * dh:].reshape(b, t, hkv, dh)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    new_k[i] = _write(cache.k[i], k, length, active)
    new_v[i] = _write(cache.v[i], v, length, active)
    x = x + _dot(_attention(q, new_k[i], new_v[i], allowed, cfg), p["wo"])
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    gate, up = jnp.split(_dot(h, p["w_gate_up"]), 2, axis=-1)
    x = x + _dot(jax.nn.silu(gate) * up, p["w_down"])
    taps[i] = x
  final = rms_norm(x, params["final_norm"], cfg.norm_eps)
  taps[cfg.num_layers] = final
  if hidden_layers:
    hidden = jnp.concatenate([taps[i] for i in hidden_layers], axis=-1)
  else:
    hidden = final
  logits = lm_head(params, cfg, final) if compute_logits else None
  step = jnp.full((b,), t, jnp.int32)
  if active is not None:
    step = jnp.where(active, step, 0)
  new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), length=length + step)
  return logits, hidden, new_cache


def chain_positions(cache: KVCache, num_new: int) -> jax.Array:
  """(B, T) positions for T chained tokens after each row's committed prefix."""
  return cache.length[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
