"""Logits -> probabilities, the one function draft and target share.

`SamplingConfig` is frozen and hashable (a static jit argument). `probs` applies
temperature, top-k and top-p exactly once; temperature 0 is greedy, returned as
the one-hot of the argmax (first index on ties), the limit of the others. Every
sampler in specjax draws from these probabilities, so the distribution a token
was drawn from (q for a drafter, p for the target) is always what the
acceptance rule sees.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from specjax.errors import ConfigValueError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 1.0
  top_k: int = 0  # 0: no top-k truncation.
  top_p: float = 1.0  # 1.0: no nucleus truncation.

  def __post_init__(self):
    for name in ("temperature", "top_k", "top_p"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigValueError(f"{name} must be a number, got {value!r}")
    if not 0 <= self.temperature < float("inf"):  # also rejects NaN
      raise ConfigValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ConfigValueError(f"top_k must be a non-negative integer, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


GREEDY = SamplingConfig(temperature=0.0)


def probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Processed probabilities over the last axis (float32), same shape as logits."""
  logits = logits.astype(jnp.float32)
  if cfg.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits / cfg.temperature
  if cfg.top_k and cfg.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if cfg.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    sorted_p = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the
    # mass strictly before it is below top_p (the top token always stays).
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = before < cfg.top_p
    keep = jnp.zeros_like(keep_sorted)
    keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


def inverse_cdf(p: jax.Array, u: jax.Array) -> jax.Array:
  """Index drawn from each row of p (..., V) by the uniforms u (...,) in [0, 1).

  Returns the number of CDF entries <= u * total, i.e. the smallest i with
  CDF(i) > u * total. Scaling u by the row's total (instead of dividing p by
  it) lets unnormalised rows, such as the residual max(0, p - q) of
  speculative sampling, be drawn from without a division. Exposed so that a
  float64 NumPy transcription can reproduce a draw from its uniform
  (`specjax.analysis.exactness.reference_inverse_cdf`).
  """
  cdf = jnp.cumsum(p, axis=-1)
  total = cdf[..., -1:]
  idx = jnp.sum(cdf <= u[..., None] * total, axis=-1)
  # Guard against float round-off at the top end: never return an index past
  # the last token with positive mass.
  last = p.shape[-1] - 1 - jnp.argmax(jnp.flip(p > 0, axis=-1), axis=-1)
  return jnp.minimum(idx, last).astype(jnp.int32)


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
  """Draw one index per row of p (..., V) with inverse-CDF sampling.

  Inverse CDF on the given probabilities (not Gumbel on logits) so that zero
  entries are never drawn and residual distributions, which exist only as
  probabilities, are sampled by the same code.
  """
  u = jax.random.uniform(key, p.shape[:-1] + (1,), dtype=jnp.float32)
  return inverse_cdf(p, u[..., 0])


def sample(key: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Sample token ids (...,) from logits (..., V); greedy is a plain argmax."""
  if cfg.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sample_from_probs(key, probs(logits, cfg))
