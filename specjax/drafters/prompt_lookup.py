"""Prompt lookup decoding (Saxena 2023): copy what followed an earlier
occurrence of the newest n-gram.

Training-free and model-free: the last g committed tokens (g from max_ngram
down to min_ngram) are searched for in the row's earlier history (prompt and
generated text); the tokens that followed the most recent match are proposed,
up to k and never past the committed history. No match -> no proposal (the
round degenerates to one AR step). The guesses are deterministic: q is their
one-hot, and the exact rule then accepts x with probability p(x) and otherwise
draws from p with x removed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import cut_at_eos, one_hot_q


def find_continuation(history, length, ngram: int):
  """Most recent earlier match of the last `ngram` tokens.

  Returns (start (B,) of the continuation, found (B,) bool). A match at j means
  history[j:j+ngram] == history[n-ngram:n] with j + ngram < n, so at least
  one continuation token exists.
  """
  b, h = history.shape
  n = length[:, None]
  width = h - ngram + 1
  j = jnp.arange(width)[None]
  match = j + ngram < n  # continuation starts inside the committed history
  match &= n >= ngram + 1
  for i in range(ngram):
    pattern = jnp.take_along_axis(history, jnp.maximum(n - ngram + i, 0), axis=1)  # (B, 1)
    match &= history[:, i:i + width] == pattern
  found = jnp.any(match, axis=1)
  last = width - 1 - jnp.argmax(match[:, ::-1], axis=1)
  return last + ngram, found


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
  max_ngram: int = 3
  min_ngram: int = 1
  name = "prompt_lookup"

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                       f"{self.max_ngram}")

  def draft(self, params, target, state, ctx, keys):
    b = ctx.length.shape[0]
    start = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for g in range(self.max_ngram, self.min_ngram - 1, -1):  # longest n-gram first
      s, f = find_continuation(ctx.history, ctx.length, g)
      start = jnp.where(found, start, s)
      found = found | f
    idx = jnp.minimum(start[:, None] + jnp.arange(self.k)[None], ctx.history.shape[1] - 1)
    tokens = jnp.take_along_axis(ctx.history, idx, axis=1)
    num = jnp.where(found & ctx.active, jnp.clip(ctx.length - start, 0, self.k), 0)
    num = cut_at_eos(tokens, num.astype(jnp.int32), target.cfg.eos_id)
    q = one_hot_q(tokens, target.cfg.vocab_size)
    return Proposal(tokens=tokens, q=q, num_proposed=num), state
