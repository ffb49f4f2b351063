"""Continuous batching for autoregressive decoding: finished rows are refilled.

`autoregressive.generate` runs a static batch until its longest answer ends;
with answers of 20 to 256 tokens most rows sit idle for most of the run. Here
a fixed batch of rows decodes in chunks of `chunk_steps` steps on device; after
each chunk the host collects the rows that finished and prefills waiting
requests into them (`refill` rows at a time, one shape per prompt bucket, so a
handful of programs serve the whole run). Throughput is what bulk generation
(self-distillation data) needs; latency of a single request is not the goal.

Each request's tokens equal what `autoregressive.generate` emits for it:
the row's key is derived from its request id, and its n-th token from
fold_in(key, n), whichever step of the batch it is decoded at
(`autoregressive.decode_step`). Under greedy decoding only the rounding of
batched matmuls, which depends on the batch's shape, can differ.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import errors
from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import batch as batch_lib
from specjax.models import cache as cache_lib
from specjax.models.config import ModelConfig


@dataclasses.dataclass
class Stats:
  """What a run did: requests, tokens, steps, prefills, wall time."""

  requests: int = 0
  new_tokens: int = 0
  decode_steps: int = 0
  row_steps: int = 0  # rows x steps decoded, busy or idle
  prefills: int = 0
  seconds: float = 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

  @property
  def occupancy(self) -> float:
    """Fraction of decoded row-steps that produced a token of a live request."""
    return (self.new_tokens - self.requests) / max(self.row_steps, 1)


def _empty_state(cfg: ModelConfig, batch_size: int, num_slots: int, max_new_tokens: int):
  b = batch_size

  def full(value):  # a buffer of its own for every field: the state is donated
    return jnp.full((b,), value, jnp.int32)

  return ar.DecodeState(
      step=jnp.zeros((), jnp.int32), cache=cache_lib.init_cache(cfg, b, num_slots),
      keys=batch_lib.request_keys(jax.random.key(0), jnp.arange(b, dtype=jnp.int32)),
      last=full(0), tokens=jnp.full((b, max_new_tokens), cfg.pad_id, jnp.int32),
      num_tokens=full(0), limit=full(1), done=jnp.ones((b,), bool), nonfinite_at=full(-1))


@functools.partial(jax.jit, donate_argnames=("state",))
def _place(state: ar.DecodeState, new: ar.DecodeState, rows: jax.Array) -> ar.DecodeState:
  """Rows `rows` of `state` replaced by `new`'s rows (an index of B drops that row)."""
  def put(full, part):
    return full.at[rows].set(part, mode="drop")
  fields = ("cache", "keys", "last", "tokens", "num_tokens", "limit", "done", "nonfinite_at")
  return state.replace(**{f: jax.tree_util.tree_map(put, getattr(state, f), getattr(new, f))
                          for f in fields})


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "steps"),
                   donate_argnames=("state",))
def _decode_chunk(params, cfg: ModelConfig, state: ar.DecodeState, *,
                  sampling: sampling_lib.SamplingConfig, steps: int) -> ar.DecodeState:
  """Up to `steps` decode steps, fewer when every row is done."""
  def cond(carry):
    i, s = carry
    return (i < steps) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    return i + 1, ar.decode_step(params, cfg, sampling, s)

  return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]


def generate(params, cfg: ModelConfig, requests: Iterable[Tuple[int, Sequence[int]]], *,
             batch_size: int, max_new_tokens: int, max_prompt_tokens: int, key=0,
             sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
             chunk_steps: int = 16, refill: Optional[int] = None,
             stats: Optional[Stats] = None) -> Iterator[Tuple[int, List[int]]]:
  """Yields (request id, emitted tokens) as requests finish (not in order).

  Args:
    requests: (request id, prompt token ids[, token limit]); ids key the
      randomness and must be distinct. Prompts longer than `max_prompt_tokens`,
      token ids outside the vocabulary, limits outside 1..max_new_tokens and a
      repeated id raise ValueError (when the request is taken).
    batch_size: rows decoded together.
    max_new_tokens: the largest token limit of a request, and the default
      (EOS ends a request earlier; it is kept).
    max_prompt_tokens: the cache is sized for this prompt length + the answer.
    chunk_steps: decode steps between visits of the host.
    refill: rows prefilled together (default batch_size // 4, at least 1): a
      prefill waits until this many rows are free or no request is left.
    stats: filled in as the run goes.
  """
  max_new_tokens = int(batch_lib.row_limits(max_new_tokens, 1)[0])  # refuses 10.5, True
  if batch_size < 1 or max_new_tokens < 1 or chunk_steps < 1:
    raise ValueError("batch_size, max_new_tokens and chunk_steps must be >= 1, got "
                     f"{batch_size}, {max_new_tokens}, {chunk_steps}")
  refill = refill or max(1, batch_size // 4)
  if not 1 <= refill <= batch_size:
    raise ValueError(f"refill must be in [1, batch_size={batch_size}], got {refill}")
  stats = stats if stats is not None else Stats()
  widest = batch_lib.prompt_bucket(max_prompt_tokens)
  num_slots = batch_lib.cache_size(cfg, widest, max_prompt_tokens, max_new_tokens, 1)
  root = batch_lib.as_key(key)
  state = _empty_state(cfg, batch_size, num_slots, max_new_tokens)
  occupant: List[Optional[int]] = [None] * batch_size
  queue = iter(requests)
  pending: List[Tuple[int, List[int], int]] = []
  seen = set()
  exhausted = False
  t0 = time.perf_counter()

  def take(n):
    nonlocal exhausted
    while len(pending) < n and not exhausted:
      try:
        rid, prompt, *limit = next(queue)
      except StopIteration:
        exhausted = True
        break
      try:
        limit = int(batch_lib.row_limits(limit[0], 1)[0]) if limit else max_new_tokens
      except ValueError as e:
        raise ValueError(f"request {rid}: token limit {limit[0]!r} is not a whole number "
                         "of tokens") from e
      if not 1 <= len(prompt) <= max_prompt_tokens:
        raise ValueError(f"request {rid}: prompt of {len(prompt)} tokens; expected 1.."
                         f"{max_prompt_tokens} (max_prompt_tokens)")
      if not 1 <= limit <= max_new_tokens:
        raise ValueError(f"request {rid}: token limit {limit}; expected 1..{max_new_tokens} "
                         "(max_new_tokens)")
      batch_lib.check_token_ids(prompt, cfg.vocab_size, f"request {rid}")
      if int(rid) in seen:  # its result would be indistinguishable, its draws the same
        raise ValueError(f"request id {rid} repeats: request ids must be distinct")
      seen.add(int(rid))
      pending.append((int(rid), list(prompt), limit))
    out = pending[:n]
    del pending[:n]
    return out

  while True:
    done = np.asarray(state.done)
    free = [r for r in range(batch_size) if done[r]]
    finished = [r for r in free if occupant[r] is not None]
    if finished:
      toks, num, bad = jax.device_get((state.tokens, state.num_tokens, state.nonfinite_at))
      for r in finished:
        if bad[r] >= 0:
          raise errors.NonFiniteLogitsError([r], [int(bad[r])], None,
                                            f"continuous batching (request {occupant[r]})")
        stats.requests += 1
        stats.new_tokens += int(num[r])
        yield occupant[r], toks[r, :num[r]].tolist()
        occupant[r] = None
    # Refill free rows, `refill` at a time; fewer only when the batch would
    # otherwise idle or no request is left.
    while free:
      idle = all(o is None for o in occupant)
      if len(free) < refill and not (idle or exhausted):
        break
      group = take(min(refill, len(free)))
      if not group:
        break
      rows, free = free[:len(group)], free[len(group):]
      pad = refill - len(group)
      prompts = [p for _, p, _ in group] + [[cfg.pad_id]] * pad
      ids = [rid for rid, _, _ in group] + [0] * pad
      # every request's ids were checked when taken; the filler rows hold pad_id
      # (which may be -1), so they are not checked against the vocabulary
      tokens, lengths = batch_lib.pad_prompts(prompts, cfg.pad_id)
      keys = batch_lib.request_keys(root, jnp.asarray(ids, jnp.int32))
      limits = jnp.asarray([lim for _, _, lim in group] + [1] * pad, jnp.int32)
      new = ar.prefill(params, cfg, keys, jnp.asarray(tokens), jnp.asarray(lengths), limits,
                       num_slots=num_slots, sampling=sampling, max_new_tokens=max_new_tokens)
      index = np.full((refill,), batch_size, np.int32)  # padding rows: dropped
      index[:len(group)] = rows
      state = _place(state, new, jnp.asarray(index))
      stats.prefills += 1
      for r, (rid, _, _) in zip(rows, group):
        occupant[r] = rid
    if all(o is None for o in occupant):
      if exhausted and not pending:
        break
      continue
    before = int(state.step)
    state = _decode_chunk(params, cfg, state, sampling=sampling, steps=chunk_steps)
    ran = int(state.step) - before
    stats.decode_steps += ran
    stats.row_steps += ran * batch_size
    stats.seconds = time.perf_counter() - t0
  stats.seconds = time.perf_counter() - t0


def generate_bucketed(params, cfg: ModelConfig, requests: Iterable[Tuple[int, Sequence[int]]],
                      *, max_prompt_tokens: int, batch_size: int,
                      **kwargs) -> Iterator[Tuple[int, List[int]]]:
  """`generate` once per prompt-length bucket (powers of two up to
  `max_prompt_tokens`), shortest bucket first, each with a cache sized for its
  own bucket: every decode step reads the whole cache, so one cache sized for
  the longest prompt makes short prompts pay for it (SmolLM2 f32, B = 8:
  0.31 s/step with 448 slots, 0.47 s/step with 896). Requests are
  materialised to be grouped; each keeps its id, so its tokens do not depend
  on the bucket it ran in (up to the rounding of batched matmuls under
  greedy decoding). Same arguments as `generate`."""
  groups, seen = {}, set()
  for req in requests:
    if int(req[0]) in seen:  # `generate` checks within a bucket; this, across them
      raise ValueError(f"request id {req[0]} repeats: request ids must be distinct")
    seen.add(int(req[0]))
    width = min(batch_lib.prompt_bucket(len(req[1])), max_prompt_tokens)
    groups.setdefault(width, []).append(req)
  for width in sorted(groups):
    reqs = sorted(groups[width], key=lambda r: len(r[1]))  # similar lengths refill together
    yield from generate(params, cfg, reqs, max_prompt_tokens=width,
                        batch_size=min(batch_size, len(reqs)), **kwargs)

