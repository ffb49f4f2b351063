"""Autoregressive decoding: the baseline every speedup is measured against.

Prefill writes each row's right-padded prompt into the cache in one forward and
sets the row's fill level to its true length; the first new token is drawn from
the logits at the row's last prompt position. Then one `lax.while_loop` on
device feeds one token per row per step until every row has hit EOS or its
token limit. Finished rows stop writing. No Python runs per token.

NaN / inf logits are never sampled from silently: a row whose logits are not
finite where its next token is chosen stops before that token and records its
index (`DecodeState.nonfinite_at`); `generate` then raises
`specjax.errors.NonFiniteLogitsError` naming the rows and tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from specjax import errors
from specjax import sampling as sampling_lib
from specjax import sharding
from specjax.decoding import batch as batch_lib
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig


@flax.struct.dataclass
class DecodeState:
  """Loop carry of autoregressive decoding."""

  step: jax.Array  # () int32: decode steps taken after prefill.
  cache: cache_lib.KVCache
  keys: jax.Array  # (B,) per-request keys.
  last: jax.Array  # (B,) the newest token, not yet in the cache.
  tokens: jax.Array  # (B, max_new_tokens) emitted tokens, pad beyond num_tokens.
  num_tokens: jax.Array  # (B,) int32
  limit: jax.Array  # (B,) int32 per-row max_new_tokens.
  done: jax.Array  # (B,) bool
  # (B,) int32: index of the output token whose logits were first seen NaN / inf
  # (the row stopped before emitting it); -1 while they are finite.
  nonfinite_at: jax.Array


def nonfinite_rows(logits: jax.Array, active: jax.Array, num_valid=None) -> jax.Array:
  """(B,) bool: active rows with a NaN / inf among their logits (B, V), or
  among the first num_valid[b] positions of (B, T, V)."""
  bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
  if num_valid is not None:
    bad = jnp.any(bad & (jnp.arange(bad.shape[1])[None] < num_valid[:, None]), axis=1)
  return active & bad


def note_nonfinite(nonfinite_at, done, bad, num_tokens):
  """Rows with `bad` logits stop (done) before emitting, and keep the index
  of the token they would have emitted: -> (nonfinite_at, done)."""
  nonfinite_at = jnp.where(bad & (nonfinite_at < 0), num_tokens, nonfinite_at)
  return nonfinite_at, done | bad


def raise_if_nonfinite(nonfinite_at, result, what: str) -> None:
  """NonFiniteLogitsError (carrying `result`) if any row saw NaN / inf logits."""
  err = errors.first_nonfinite(np.asarray(nonfinite_at), result, what)
  if err is not None:
    raise err


def sample_rows(keys: jax.Array, logits: jax.Array, sampling: sampling_lib.SamplingConfig):
  """One token per row, each row with its own key: (B,) keys, (B, V) logits."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  # The probabilities for the whole batch, outside the vmap: under vmap
  # top-p's candidate-or-sort branch (`sampling.nucleus`) would become a
  # select that runs the full sort every step.
  p = sampling_lib.probs(logits, sampling)
  return jax.vmap(sampling_lib.sample_from_probs)(keys, p)


def emit(tokens, num_tokens, done, limit, new, eos_id, pad_id):
  """Append one token to each unfinished row; returns (tokens, num_tokens, done)."""
  active = ~done
  b = tokens.shape[0]
  col = jnp.where(active, num_tokens, tokens.shape[1])  # out of range -> dropped
  tokens = tokens.at[jnp.arange(b), col].set(new, mode="drop")
  num_tokens = num_tokens + active.astype(jnp.int32)
  done = done | (active & ((new == eos_id) | (num_tokens >= limit)))
  return tokens, num_tokens, done


@functools.partial(jax.jit, static_argnames=("cfg", "num_slots", "hidden_layers"))
def prompt_forward(params, cfg: ModelConfig, prompt_tokens, prompt_lengths, *, num_slots: int,
                   hidden_layers=None):
  """The prompts' forward: -> (logits at each row's last prompt position (B, V),
  the cache filled to the prompt lengths, the hidden states of `hidden_layers`
  (B, T, Df) or None).

  Its own program, independent of the sampling settings and the drafter: one
  compile of the whole model's prompt forward per (shapes, hidden_layers)
  serves AR and every drafter, greedy and sampled (the first token is drawn by
  `first_token`, a small program)."""
  b, t = prompt_tokens.shape
  cache = cache_lib.init_cache(cfg, b, num_slots)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # The final normed state is the last tap; the LM head runs only at each
  # row's last prompt position (B rows, not B x T: a prompt's other logits are
  # never read). Prefill is shared by AR and speculative runs: never the
  # batch-invariant form.
  taps = tuple(hidden_layers or ()) + (cfg.num_layers,)
  _, hidden, cache = transformer.forward(params, cfg, prompt_tokens, positions, cache,
                                         hidden_layers=taps, compute_logits=False,
                                         batch_invariant=False)
  cache = cache.with_length(prompt_lengths)
  last = jnp.take_along_axis(hidden[..., -cfg.dim:], (prompt_lengths - 1)[:, None, None],
                             axis=1)[:, 0]
  first_logits = transformer.lm_head(params, cfg, last)
  if hidden_layers is None:
    return first_logits, cache, None
  return first_logits, cache, (hidden[..., :-cfg.dim] if hidden_layers else hidden)


class PromptForwards:
  """Prompt forwards shared by the runs this object is handed to.

  A benchmark that decodes one batch of prompts with several methods (AR and
  every drafter) runs `prompt_forward` once per distinct (params, prompts,
  cache size, hidden layers) instead of once per method: AR and most drafters
  share its result, EAGLE and EAGLE-3 each add the forward that returns their
  hidden layers. The result is the one program's output either way (prefill
  is deterministic and outside the decode loop), so what each method decodes
  does not change. Each run gets its own copy (the loop consumes its cache).
  Entries hold their params object (keyed by identity) and the prompts' cache:
  hand one object per batch of prompts, and drop it after."""

  def __init__(self):
    self._entries = {}
    self.computed = 0  # prompt forwards run
    self.reused = 0  # prompt forwards served from an earlier run's

  def __call__(self, params, cfg: ModelConfig, prompt_tokens, prompt_lengths, *,
               num_slots: int, hidden_layers=None):
    tokens, lengths = np.asarray(prompt_tokens), np.asarray(prompt_lengths)
    key = (id(params), cfg, num_slots, hidden_layers, tokens.shape, tokens.tobytes(),
           lengths.tobytes())
    entry = self._entries.get(key)
    if entry is None or entry[0] is not params:
      out = prompt_forward(params, cfg, prompt_tokens, prompt_lengths, num_slots=num_slots,
                           hidden_layers=hidden_layers)
      self._entries[key] = entry = (params, out)
      self.computed += 1
    else:
      self.reused += 1
    return jax.tree.map(jnp.copy, entry[1])


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_new_tokens"),
                   donate_argnames=("cache",))
def first_token(cfg: ModelConfig, keys, first_logits, cache, limit, *,
                sampling: sampling_lib.SamplingConfig, max_new_tokens: int) -> DecodeState:
  """The first token of every row from its prompt's last logits (B, V): the
  initial DecodeState around the prompts' `cache`."""
  b = first_logits.shape[0]
  first = sample_rows(batch_lib.purpose_keys(keys, batch_lib.PREFILL_SAMPLE), first_logits,
                      sampling)
  tokens = jnp.full((b, max_new_tokens), cfg.pad_id, jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)
  nonfinite_at, done = note_nonfinite(zeros - 1, jnp.zeros((b,), bool),
                                      nonfinite_rows(first_logits, jnp.ones((b,), bool)), zeros)
  tokens, num_tokens, done = emit(tokens, zeros, done, limit, first, cfg.eos_id, cfg.pad_id)
  return DecodeState(step=jnp.zeros((), jnp.int32), cache=cache, keys=keys, last=first,
                     tokens=tokens, num_tokens=num_tokens, limit=limit, done=done,
                     nonfinite_at=nonfinite_at)


def prefill(params, cfg: ModelConfig, keys, prompt_tokens, prompt_lengths, limit, *,
            num_slots: int, sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
            hidden_layers=None, prompt_forwards: Optional[PromptForwards] = None):
  """Prompt forward + first token (two programs: `prompt_forward`, shared by
  every sampling setting and drafter, then `first_token`). Returns the initial
  DecodeState, or (DecodeState, hidden (B, T, Df)) when `hidden_layers` is
  given (a tuple, as `transformer.forward` takes it; () for the final normed
  state). `prompt_forwards`: run the prompt forward through it (shared with
  other runs of the same prompts)."""
  forward = prompt_forwards or prompt_forward
  first_logits, cache, hidden = forward(params, cfg, prompt_tokens, prompt_lengths,
                                        num_slots=num_slots, hidden_layers=hidden_layers)
  state = first_token(cfg, keys, first_logits, cache, limit, sampling=sampling,
                      max_new_tokens=max_new_tokens)
  return state if hidden_layers is None else (state, hidden)


def decode_step(params, cfg: ModelConfig, sampling: sampling_lib.SamplingConfig,
                state: DecodeState) -> DecodeState:
  active = ~state.done
  positions = state.cache.length[:, None]
  logits, _, cache = transformer.forward(params, cfg, state.last[:, None], positions,
                                         state.cache, active=active)
  # Each row's key for its n-th token: a row's tokens depend on its request
  # alone, not on when it joined the batch (continuous batching refills rows).
  keys = batch_lib.purpose_keys(state.keys, batch_lib.DECODE_STEP, state.num_tokens - 1)
  new = sample_rows(keys, logits[:, 0], sampling)
  nonfinite_at, done = note_nonfinite(state.nonfinite_at, state.done,
                                      nonfinite_rows(logits[:, 0], active), state.num_tokens)
  active = ~done
  new = jnp.where(active, new, cfg.pad_id)
  tokens, num_tokens, done = emit(state.tokens, state.num_tokens, done, state.limit, new,
                                  cfg.eos_id, cfg.pad_id)
  return state.replace(step=state.step + 1, cache=cache, last=jnp.where(active, new, state.last),
                       tokens=tokens, num_tokens=num_tokens, done=done,
                       nonfinite_at=nonfinite_at)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
def decode(params, cfg: ModelConfig, state: DecodeState, *,
           sampling: sampling_lib.SamplingConfig) -> DecodeState:
  """Run decode steps on device until every row is done."""
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                            functools.partial(decode_step, params, cfg, sampling), state)


@dataclasses.dataclass
class GenerateResult:
  """Host-side result of one batched generation."""

  tokens: list  # per row: list[int] of emitted tokens (EOS included when hit).
  prefill_s: float  # time to first token (prefill + first sample).
  decode_s: float  # time of the decode loop.
  num_slots: int
  stats: dict = dataclasses.field(default_factory=dict)

  @property
  def num_new_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens produced by the decode loop (the first comes from prefill) per second."""
    n = self.num_new_tokens - len(self.tokens)
    return n / self.decode_s if self.decode_s > 0 else float("nan")


def prepare(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens,
            block: int, cache_slots: Optional[int] = None, width: Optional[int] = None):
  """Pad prompts, size the cache, per-row limits. Raises on requests that cannot fit.

  `width`: the new-token buffer the cache is sized for (default the largest
  limit); runs with other limits but the same width share one program."""
  tokens, lengths = batch_lib.pad_prompts(prompts, cfg.pad_id, vocab_size=cfg.vocab_size)
  limits = batch_lib.row_limits(max_new_tokens, len(lengths))
  if limits.min() < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {limits.min()}")
  if width is None:
    width = int(limits.max())
  elif width < limits.max():
    raise ValueError(f"width {width} is below the largest max_new_tokens ({limits.max()})")
  num_slots = batch_lib.cache_size(cfg, tokens.shape[1], int(lengths.max()), width, block,
                                   cache_slots)
  for i, (n, lim) in enumerate(zip(lengths, limits)):
    cache_lib.check_capacity(num_slots, int(n), int(lim), block)
  return tokens, lengths, limits, width, num_slots


def unpack(tokens: np.ndarray, num_tokens: np.ndarray) -> list:
  return [tokens[i, :num_tokens[i]].tolist() for i in range(tokens.shape[0])]


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, key=0,
             sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
             max_new_tokens=64, request_ids=None,
             cache_slots: Optional[int] = None, mesh=None,
             width: Optional[int] = None,
             prompt_forwards: Optional[PromptForwards] = None) -> GenerateResult:
  """Generate continuations of token-id prompts (ragged lengths allowed).

  Args:
    key: seed or PRNG key; each row's randomness comes from fold_in(key, request id).
    max_new_tokens: int or per-row sequence.
    request_ids: per-row ids for key derivation (default 0..B-1).
    cache_slots: cache capacity cap (default the model's context length).
    mesh: optional (data, model) `jax.sharding.Mesh` (`specjax.sharding`): the
      batch runs split over `data`, the weights over `model`; same outputs.
    width: the new-token buffer (default the largest max_new_tokens): a run
      with limits of 1 and the width of a longer one compiles the same programs
      without decoding (how the benchmark keeps compiles out of its timings).
    prompt_forwards: a `PromptForwards` shared with other runs of the same
      prompts (their prompt forward runs once).

  Raises:
    NonFiniteLogitsError: some row's logits were NaN / inf where a token was
      to be chosen (the error carries the result, cut before those tokens).
  """
  n = len(prompts)
  if mesh is not None:
    prompts, max_new_tokens, request_ids = sharding.pad_requests(prompts, max_new_tokens,
                                                                 request_ids, mesh)
    params = sharding.place_params(params, mesh)
  tokens, lengths, limits, width, num_slots = prepare(cfg, prompts, max_new_tokens, 1,
                                                      cache_slots, width)
  keys = batch_lib.request_keys(batch_lib.as_key(key),
                                batch_lib.request_ids_for(len(prompts), request_ids))
  inputs = (keys, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(limits))
  if mesh is not None:
    inputs = sharding.place_batch(inputs, len(prompts), mesh)
  t0 = time.perf_counter()
  state = prefill(params, cfg, *inputs, num_slots=num_slots, sampling=sampling,
                  max_new_tokens=width, prompt_forwards=prompt_forwards)
  if mesh is not None:  # the loop state as the loop will carry it
    state = sharding.place_batch(state, len(prompts), mesh)
  state.num_tokens.block_until_ready()
  t1 = time.perf_counter()
  state = decode(params, cfg, state, sampling=sampling)
  out_tokens, num, nonfinite_at = jax.device_get((state.tokens, state.num_tokens,
                                                  state.nonfinite_at))
  t2 = time.perf_counter()
  result = GenerateResult(tokens=unpack(out_tokens[:n], num[:n]), prefill_s=t1 - t0,
                          decode_s=t2 - t1, num_slots=num_slots,
                          stats={"decode_steps": int(state.step)})
  raise_if_nonfinite(nonfinite_at[:n], result, "autoregressive decoding")
  return result
