"""Measured costs of this machine: target forward time vs tokens per forward.

A verify forward over n tokens is not free on a CPU; the calibrated speedup
prediction (`theory.predicted_speedup`) and the cost-chosen draft length use
this curve instead of the one-step-per-verify assumption of the papers.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("cfg", "n", "steps", "layers"))
def _forward_loop(params, cfg: ModelConfig, cache, *, n: int, steps: int, layers=None):
  """`steps` forwards of n tokens at the same offset, inside one program (no
  dispatch overhead in the measurement)."""
  def body(i, carry):
    cache, tok = carry
    logits, _, cache = transformer.forward(params, cfg, tok, transformer.chain_positions(cache, n),
                                           cache, layers=layers)
    cache = cache.with_length(cache.length - n)
    return cache, jnp.argmax(logits, -1).astype(jnp.int32) % cfg.vocab_size
  tok = jnp.ones((cache.batch_size, n), jnp.int32)
  return jax.lax.fori_loop(0, steps, body, (cache, tok))[1]


def forward_cost_curve(params, cfg: ModelConfig, ns: Sequence[int] = (1, 2, 4, 8, 16),
                       fill: int = 256, batch_size: int = 1, steps: int = 8,
                       repeats: int = 3, layers=None) -> Dict[int, float]:
  """Median seconds of one forward of n new tokens at cache fill `fill`, for each n.

  Measured interleaved (n varies fastest) so machine noise hits all n alike.
  """
  slots = cache_lib.round_up(fill + max(ns) + 1, 16)
  cache = cache_lib.init_cache(cfg, batch_size, slots).with_length(
      jnp.full((batch_size,), fill, jnp.int32))
  times = {n: [] for n in ns}
  for n in ns:  # compile
    _forward_loop(params, cfg, cache, n=n, steps=steps, layers=layers).block_until_ready()
  for _ in range(repeats):
    for n in ns:
      t0 = time.perf_counter()
      _forward_loop(params, cfg, cache, n=n, steps=steps, layers=layers).block_until_ready()
      times[n].append((time.perf_counter() - t0) / steps)
  return {n: statistics.median(v) for n, v in times.items()}


def draft_cost(params, cfg: ModelConfig, drafter, draft_params, prompt, *, steps: int = 8,
               repeats: int = 3, num_slots: Optional[int] = None,
               sampling=None, batch_size: int = 1) -> float:
  """Median seconds of one `drafter.propose` (all k guesses) after prefilling
  `prompt` (token ids) in each of `batch_size` rows, measured in one jitted
  loop of `steps` proposals.

  The proposals are not committed (each starts from the same state); a data
  dependency through the loop keeps XLA from hoisting or merging them. A
  drafter with no device work (prompt lookup's n-gram search is device work)
  measures ~0.
  """
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel
  spec = sp.SpecConfig() if sampling is None else sp.SpecConfig(sampling=sampling)
  state = sp.start(params, cfg, drafter, [list(prompt)] * batch_size, draft_params=draft_params,
                   spec=spec, cache_slots=num_slots)
  loop = _draft_loop(params, cfg, drafter, draft_params, state, steps)
  loop.block_until_ready()  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _draft_loop(params, cfg, drafter, draft_params, state, steps).block_until_ready()
    times.append((time.perf_counter() - t0) / steps)
  return statistics.median(times)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "steps"))
def _draft_loop(params, cfg, drafter, draft_params, state, steps):
  from specjax.decoding import batch as batch_lib  # pylint: disable=import-outside-toplevel
  from specjax.drafters.base import Context, Target  # pylint: disable=import-outside-toplevel

  def body(i, zero):
    # `zero` is always 0, but XLA cannot know it: each proposal depends on the last.
    ctx = Context(history=state.history, length=state.length + zero,
                  prompt_len=state.prompt_len, active=~state.done)
    keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, state.round + i)
    proposal, _, _ = drafter.propose(draft_params, Target(params, cfg), state.drafter, ctx,
                                     state.cache, keys)
    # Use every output (all k tokens, their q, the counts), or XLA drops the
    # work that produced the unused ones.
    used = (jnp.abs(proposal.tokens).sum() + jnp.abs(proposal.num_proposed).sum()
            + (proposal.q.sum() > -1.0).astype(jnp.int32))
    return jnp.minimum(used, 0).astype(jnp.int32) + zero
  return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.int32))
