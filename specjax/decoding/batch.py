"""Requests -> device batches: right-padded prompts in length buckets, cache
sizing with an up-front capacity check, and per-request PRNG keys.

Keys are derived from the request id, not the batch slot, so a request's
sampled output does not depend on which other requests share its batch, on
the batch size, or (later) on how the batch is sharded.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import BadInputError
from specjax.models.cache import check_capacity, round_up
from specjax.models.config import ModelConfig

# Purposes of keys derived from a request key (fold_in constants). One purpose,
# one stream: no key is used for two things.
PREFILL_SAMPLE = 0
DECODE_STEP = 1
DRAFT = 2
ACCEPT = 3

# Cache sizes are multiples of this; with widths bucketed, few distinct shapes.
SLOT_MULTIPLE = 16
# With `ModelConfig.batch_invariant`, every run reserves this many slots past
# its answer for a forward block, whatever its own block: the attention's
# reduction over slots then has the same length in AR and speculative runs.
INVARIANT_BLOCK = 64


def prompt_bucket(length: int, minimum: int = 8) -> int:
  """Prompt lengths are padded to powers of two (>= minimum): every distinct
  padded length compiles a new prefill."""
  b = minimum
  while b < length:
    b *= 2
  return b


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int,
                bucket: Optional[int] = None,
                vocab_size: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad token lists to one (B, T) array; returns (tokens, lengths).
  With `vocab_size`, every id must be an integer in [0, vocab_size) (an id past
  the embedding rows would be clamped or wrapped silently); without it the
  rows are not checked (internal filler rows may hold a pad_id of -1)."""
  if not prompts:
    raise ValueError("no prompts given")
  lengths = np.array([len(p) for p in prompts], np.int32)
  if lengths.min() < 1:
    raise ValueError("every prompt needs at least one token")
  if vocab_size is not None:
    for i, p in enumerate(prompts):
      check_token_ids(p, vocab_size, f"prompt {i}")
  width = bucket or prompt_bucket(int(lengths.max()))
  if width < lengths.max():
    raise ValueError(f"bucket {width} is shorter than the longest prompt ({lengths.max()})")
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = np.asarray(p, np.int32)
  return tokens, lengths


def row_limits(max_new_tokens, num_rows: int) -> np.ndarray:
  """(num_rows,) int32 token limits from one limit or one per row (ValueError
  naming the lengths otherwise)."""
  limits = np.asarray(max_new_tokens)
  whole = (np.issubdtype(limits.dtype, np.integer) or
           (np.issubdtype(limits.dtype, np.floating) and bool(np.all(np.isfinite(limits))) and
            bool(np.all(limits == np.round(limits)))))
  if not whole:  # 10.5 would be cut to 10; True (numpy's bool is neither kind) taken as 1
    raise ValueError(f"max_new_tokens: a whole number of tokens (or one per prompt), got "
                     f"{max_new_tokens!r}")
  if limits.size != 1 and limits.shape != (num_rows,):
    got = limits.shape[0] if limits.ndim == 1 else limits.shape
    raise ValueError(f"max_new_tokens: one limit for every prompt, or one per prompt "
                     f"({num_rows}); got {got}")
  return np.broadcast_to(limits.astype(np.int32).reshape(-1), (num_rows,)).copy()


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
  """BadInputError unless `ids` is a flat sequence of integers in [0, vocab_size);
  the message names `what` and the position."""
  row = np.asarray(ids)
  if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
    raise BadInputError(f"{what}: token ids must be a flat list of integers, got "
                        f"{row.dtype} values of shape {row.shape}")
  bad = np.flatnonzero((row < 0) | (row >= vocab_size))
  if bad.size:
    raise BadInputError(f"{what}: token id {int(row[bad[0]])} at position {int(bad[0])} is "
                        f"outside the vocabulary [0, {vocab_size})")


def cache_size(cfg: ModelConfig, prompt_width: int, max_prompt_len: int,
               max_new_tokens: int, block: int, requested: Optional[int] = None) -> int:
  """Slots to allocate: prompt + new tokens + one forward block must fit.

  Sized from the bucketed prompt width, not the exact length, so that prompts
  of one bucket share one compiled program; never beyond the model's context
  length (or the requested cap), where the exact length decides.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if cfg.batch_invariant:  # AR (block 1) and speculative runs get the same cache size
    block = max(block, INVARIANT_BLOCK)
  limit = cfg.max_seq_len if requested is None else int(requested)
  check_capacity(limit, max_prompt_len, max_new_tokens, block)
  need = prompt_width + max_new_tokens + block
  return max(min(round_up(need, SLOT_MULTIPLE), limit), prompt_width)


def request_keys(key: jax.Array, request_ids: jax.Array) -> jax.Array:
  """(B,) keys, one per request id."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, request_ids)


def purpose_keys(keys: jax.Array, purpose: int, step=None) -> jax.Array:
  """Per-row keys for one purpose (and step): fold_in(fold_in(k, purpose), step).
  `step` is one number for every row or a (B,) array, one per row."""
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, purpose)
  if step is not None:
    step = jnp.asarray(step)
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, 0 if step.ndim else None))(keys, step)
  return keys


def as_key(seed_or_key) -> jax.Array:
  if isinstance(seed_or_key, (int, np.integer)):
    return jax.random.key(int(seed_or_key))
  return seed_or_key


def request_ids_for(batch_size: int, request_ids=None) -> jnp.ndarray:
  if request_ids is None:
    return jnp.arange(batch_size, dtype=jnp.int32)
  ids = jnp.asarray(request_ids, jnp.int32)
  if ids.shape != (batch_size,):
    raise ValueError(f"request_ids must have shape ({batch_size},), got {ids.shape}")
  return ids
