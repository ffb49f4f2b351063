"""Greedy identity with an honest near-tie rule.

A forward over T tokens and T one-token steps agree only up to float round-off
(~1e-4 in f32 on SmolLM2), so a greedy speculative run may legitimately pick
the other of two near-tied tokens. A divergence from the AR greedy reference
is allowed only where the reference's top-1 / top-2 logit gap is below delta,
a threshold set from the measured block-vs-step difference of the precision;
comparison stops there and the case is counted. Any other divergence fails.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig


@dataclasses.dataclass
class Comparison:
  status: str  # "identical", "near_tie" or "diverged"
  position: Optional[int] = None  # first differing generated position
  gap: Optional[float] = None  # reference top-1 minus top-2 logit there


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, cfg: ModelConfig, tokens):
  n, t = tokens.shape
  cache = cache_lib.init_cache(cfg, n, t)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
  return transformer.forward(params, cfg, tokens, pos, cache)[0]


def top_gap(params, cfg: ModelConfig, prompt: Sequence[int], generated: Sequence[int],
            position: int, bucket: int = 64) -> float:
  """Reference top-1 minus top-2 logit for generated[position] (teacher forced)."""
  seq = list(prompt) + list(generated[:position])
  width = -(-len(seq) // bucket) * bucket
  buf = np.full((1, width), cfg.pad_id, np.int32)
  buf[0, :len(seq)] = seq
  row = np.asarray(_logits(params, cfg, jnp.asarray(buf))[0, len(seq) - 1], np.float64)
  top2 = np.sort(row)[-2:]
  return float(top2[1] - top2[0])


def compare(params, cfg: ModelConfig, prompt, reference, candidate, delta: float) -> Comparison:
  """Compare a candidate greedy output with the AR reference under the near-tie rule."""
  for i, (a, b) in enumerate(zip(reference, candidate)):
    if a != b:
      gap = top_gap(params, cfg, prompt, reference, i)
      return Comparison("near_tie" if gap < delta else "diverged", i, gap)
  if len(reference) != len(candidate):
    i = min(len(reference), len(candidate))
    return Comparison("diverged", i, None)
  return Comparison("identical")


def block_vs_step_difference(params, cfg: ModelConfig, prompt: Sequence[int],
                             continuation: Sequence[int]) -> float:
  """Max |logits| difference between one forward over the continuation and
  one-token steps, after the prompt: the precision's own noise floor."""
  n = len(continuation)
  slots = cache_lib.round_up(len(prompt) + n + 1, 16)
  c = cache_lib.init_cache(cfg, 1, slots)
  p = jnp.asarray([prompt], jnp.int32)
  fwd = jax.jit(transformer.forward, static_argnames=("cfg",))
  _, _, c = fwd(params, cfg, p, transformer.chain_positions(c, p.shape[1]), c)
  cont = jnp.asarray([continuation], jnp.int32)
  block, _, _ = fwd(params, cfg, cont, transformer.chain_positions(c, n), c)
  steps = []
  for i in range(n):
    lg, _, c = fwd(params, cfg, cont[:, i:i + 1], transformer.chain_positions(c, 1), c)
    steps.append(lg)
  return float(jnp.max(jnp.abs(block - jnp.concatenate(steps, 1))))
