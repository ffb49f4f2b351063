"""Explicit KV cache pytree with a per-row fill level.

Slot `s` of row `b` holds the keys/values of the token written there; slots at
or beyond `length[b]` are stale and never attended to (the attention mask is
built from `length`). Rolling back rejected guesses is therefore a change of
`length` only -- nothing is copied or cleared.
"""

from __future__ import annotations

from typing import Tuple

import flax
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values, each (B, S, G, Dh), plus the fill level (B,)."""

  k: Tuple[jax.Array, ...]
  v: Tuple[jax.Array, ...]
  length: jax.Array  # (B,) int32: number of valid slots per row.

  @property
  def batch_size(self) -> int:
    return self.length.shape[0]

  @property
  def num_slots(self) -> int:
    return self.k[0].shape[1]

  def with_length(self, length) -> "KVCache":
    return self.replace(length=jnp.asarray(length, jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, num_slots: int,
               dtype=None) -> KVCache:
  """An empty cache for `batch_size` rows of `num_slots` slots each."""
  if num_slots <= 0:
    raise ValueError(f"num_slots must be positive, got {num_slots}")
  dtype = dtype or cfg.jnp_dtype
  shape = (batch_size, num_slots, cfg.num_kv_heads, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                 length=jnp.zeros((batch_size,), jnp.int32))


def cache_slots_needed(prompt_len: int, max_new_tokens: int, block: int = 1) -> int:
  """Slots a request needs: the prompt, every new token, and the widest block
  a single forward writes past the committed prefix (k + 1 for verification).
  """
  return int(prompt_len) + int(max_new_tokens) + int(block)


def check_capacity(num_slots: int, prompt_len: int, max_new_tokens: int,
                   block: int = 1) -> None:
  """Raise a clear error if a request cannot fit the cache.

  Writes past the last slot are dropped by the scatter (never clamped onto
  valid entries), but a request that does not fit would still lose tokens:
  refuse it up front.
  """
  need = cache_slots_needed(prompt_len, max_new_tokens, block)
  if need > num_slots:
    raise ValueError(
        f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} + a "
        f"{block}-token forward block needs {need} cache slots, but the cache "
        f"has {num_slots}; shorten the prompt, lower max_new_tokens or enlarge "
        "the cache")


def round_up(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple
