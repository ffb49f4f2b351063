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
import math
import numbers
from typing import Tuple

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
    if not math.isfinite(self.top_k) or int(self.top_k) != self.top_k or self.top_k < 0:
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
  # Shifted by the row's max before the division: at a tiny temperature
  # logits / T reaches ~1e11, where one ulp is ~1e4 and a max and an element
  # rounded in different fusions differ by far more than exp's range (inf / inf
  # = NaN, silently drawn as token 0); shifted, the top token is exactly 0.
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / cfg.temperature
  if cfg.top_k and cfg.top_k < logits.shape[-1]:
    # The k-th largest as the min of the top-k values: slicing it out of
    # `top_k`'s output makes XLA CPU lower `top_k` as a full sort (~10 ms a
    # row over SmolLM2's 49,152 tokens, against 0.1 ms); the value is the same.
    kth = jnp.min(jax.lax.top_k(logits, cfg.top_k)[0], axis=-1, keepdims=True)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if cfg.top_p < 1.0:
    logits = jnp.where(nucleus(logits, cfg.top_p), logits, -jnp.inf)
  return jax.nn.softmax(logits, axis=-1)


# Candidate counts tried in turn before the full sort: the nucleus lies inside
# the top m tokens whenever their mass reaches top_p (SmolLM2 at T = 1 on its
# own answers: 99.2% of positions for m = 256, all of them for m = 4096).
NUCLEUS_CANDIDATES = (256, 4096)


def nucleus(logits: jax.Array, top_p: float,
            candidates: Tuple[int, ...] = NUCLEUS_CANDIDATES) -> jax.Array:
  """Bool mask of the top-p nucleus over the last axis: the smallest set of
  highest-probability tokens (ties: lower index first) whose mass reaches
  top_p, i.e. token i stays if the mass strictly before it is below top_p.

  The full sort the definition reads costs ~12 ms a row on CPU at V = 49,152;
  the nucleus is found among the top m tokens (`lax.top_k`, in the same order)
  whenever their mass reaches top_p for every row, trying each m of
  `candidates` before falling back to the sort. Each way gives the same set
  (up to float round-off in the running sum at the top_p boundary).
  """
  v = logits.shape[-1]
  m = next((c for c in candidates if c < v), None)
  if m is None:
    return _nucleus_sorted(logits, top_p)
  top = jnp.max(logits, axis=-1, keepdims=True)
  total = jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)
  vals, idx = jax.lax.top_k(logits, m)
  p = jnp.exp(vals - top) / total
  before = jnp.cumsum(p, axis=-1) - p
  covered = jnp.all(before[..., -1] + p[..., -1] >= top_p)  # the next token is out

  def inside(operands):
    logits, idx, keep = operands
    return jnp.put_along_axis(jnp.zeros(logits.shape, bool), idx, keep, axis=-1, inplace=False)

  def beyond(operands):
    rest = tuple(c for c in candidates if c > m)
    return nucleus(operands[0], top_p, rest)

  return jax.lax.cond(covered, inside, beyond, (logits, idx, before < top_p))


def _nucleus_sorted(logits: jax.Array, top_p: float) -> jax.Array:
  """`nucleus` by the definition: a full (stable, descending) sort."""
  order = jnp.argsort(-logits, axis=-1)
  sorted_p = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
  before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
  keep = jnp.zeros(logits.shape, bool)
  return jnp.put_along_axis(keep, order, before < top_p, axis=-1, inplace=False)


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
