"""Row-wise building blocks shared by the decoder's forwards
(`transformer.forward` and the batch-invariant `invariant.forward`)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half layout. x: (B, T, H, Dh); positions: (B, T)."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, Dh/2)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
  table = params["embed"]
  if table.dtype == jnp.bfloat16:
    # Gather the raw 16-bit rows. A plain take-then-convert lets XLA rewrite
    # it into take(convert(table)) and share that full float32 copy with the
    # tied LM head, which then materialises 113 MB per step (~65 ms on CPU).
    rows = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), tokens, axis=0)
    return jax.lax.bitcast_convert_type(rows, jnp.bfloat16).astype(jnp.float32)
  return jnp.take(table, tokens, axis=0).astype(jnp.float32)


def write_cache(cache_arr: jax.Array, new: jax.Array, start: jax.Array,
           active: Optional[jax.Array]) -> jax.Array:
  """Scatter new (B, T, G, Dh) into slots start[b] + t. Inactive rows and
  out-of-range slots are dropped, never clamped onto valid entries."""
  b, t = new.shape[:2]
  s = cache_arr.shape[1]
  slot = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if active is not None:
    slot = jnp.where(active[:, None], slot, s)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  new = new.astype(cache_arr.dtype)
  if cache_arr.dtype == jnp.bfloat16 and t > 1:
    # Scatter the raw 16-bit values: XLA CPU has no bfloat16 scatter and would
    # convert the whole cache to float32 and back around it (a verify block's
    # write then costs ~O(cache) per layer: ~40% of a 5-token verify forward
    # after 1,200 tokens on a 2-core CPU). The bits are the same. (One token
    # per row XLA writes in place; the 16-bit form would copy the cache.)
    u16 = jax.lax.bitcast_convert_type
    out = u16(cache_arr, jnp.uint16).at[rows, slot].set(u16(new, jnp.uint16), mode="drop")
    return u16(out, jnp.bfloat16)
  return cache_arr.at[rows, slot].set(new, mode="drop")
