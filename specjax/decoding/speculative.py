"""Speculative decoding: draft -> verify in ONE target forward -> accept -> commit.

Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318).
Each round, every active row:

1. asks the drafter for up to K guesses x_1..x_K with the distributions
   q_1..q_K they were drawn from;
2. feeds [last, x_1, ..., x_K] to the target in one forward at the row's own
   cache offset (K + 1 tokens: the newest committed token, not yet in the
   cache, then the guesses), giving p_1..p_{K+1};
3. applies the acceptance rule (`specjax.verify`): keeps n guesses and draws
   one more token y (residual at the first rejection, or the bonus);
4. commits x_1..x_n, y to the row's history, cut at EOS and at the row's token
   limit; the target cache keeps exactly the entries of the committed prefix
   by setting its fill level (rejected slots become stale, nothing is copied);
   the drafter is brought to the committed state.

A tree drafter (Medusa's static trees, EAGLE-2's dynamic ones, Lookahead's
candidate trie) proposes N nodes with parents instead of a chain
(`Proposal.parent`); the same round feeds [root, node 0, ..., node N - 1] in
one forward, node j at RoPE position (length - 1) + depth(j) under an
ancestor-only mask (`specjax.trees`), verifies the tree
(`verify.tree_accept`, exact for any temperature; `verify.tree_greedy_accept`
for greedy targets), gathers the accepted path's cache entries into the slots
right after the root (`trees.commit_path`) and hands the drafter the verify
features of the root and the accepted path as a chain.

Everything runs in one `lax.while_loop` on device; rows accept different
numbers of tokens per round and finish independently.

A row whose verify logits hold NaN / inf at a position that chose one of this
round's tokens (the root and the accepted guesses) stops before that round
emits anything and records the index of the token it would
have emitted (`SpecState.nonfinite_at`); `generate` raises
`specjax.errors.NonFiniteLogitsError`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax import sharding
from specjax import trees
from specjax import verify
from specjax.decoding import autoregressive as ar
from specjax.decoding import batch as batch_lib
from specjax.drafters.base import Context, Drafter, Target, VerifyOutput
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

RULES = ("exact", "typical")


@flax.struct.dataclass
class Metrics:
  """Per-row counters; cut tokens (past EOS / the limit) count in none."""

  rounds: jax.Array  # (B,) target decode forwards while the row was active
  emitted: jax.Array  # (B,) tokens emitted by verify rounds (prefill's first excluded)
  proposed: jax.Array  # (B,) guesses evaluated, up to and including the first rejection
  accepted: jax.Array  # (B,) guesses accepted
  accept_hist: jax.Array  # (B, K + 1) rounds by number of accepted guesses
  reached: jax.Array  # (B, K) rounds in which guess i was evaluated
  kept: jax.Array  # (B, K) rounds in which guess i was accepted
  narrow: jax.Array  # (B,) rounds verified by a 1-token forward (no row proposed)
  verified: jax.Array  # (B,) tokens fed to the verify forwards (their widths), summed


@flax.struct.dataclass
class SpecState:
  """Loop carry of speculative decoding."""

  round: jax.Array  # () int32
  cache: cache_lib.KVCache  # target cache: holds history[:length - 1]
  drafter: Any
  keys: jax.Array  # (B,) per-request keys
  history: jax.Array  # (B, H) prompt + emitted tokens
  length: jax.Array  # (B,) committed tokens
  prompt_len: jax.Array  # (B,)
  num_tokens: jax.Array  # (B,) emitted tokens (first one from prefill)
  limit: jax.Array  # (B,)
  done: jax.Array  # (B,)
  metrics: Metrics
  # (B,) int32: output token index where NaN / inf target logits were first
  # seen (the row stopped before it); -1 while they are finite.
  nonfinite_at: jax.Array


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of a speculative run.

  `rule` is "exact" (chain rejection sampling; greedy verification when the
  target samples at temperature 0), "typical" (Medusa's, lossy), or a callable
  `rule(keys, draft_tokens, q, p, num_proposed, logits) -> (num_accepted,
  next_token)` -- how researchers (and the negative controls of the test
  suite) plug in their own rule; a custom rule is labelled lossy unless it
  says otherwise with an attribute `exact = True`. `accept_purpose` names the
  key stream of the acceptance uniforms; it exists so that a test can reuse
  the drafting stream and show that such a reuse is caught.

  `narrow_verify`: when no active row proposed a guess (prompt lookup without
  a match), verify with a 1-token forward instead of K + 1 (a K + 1 forward
  costs ~1.5x a 1-token one on CPU); the emitted token is the same. Drafters
  whose proposals vary in length (`Drafter.verify_widths`, e.g. a dynamic
  draft length) are verified at the narrowest of their widths that holds
  every active row's proposal.
  """

  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY  # the target's p
  rule: Any = "exact"
  accept_purpose: int = batch_lib.ACCEPT
  narrow_verify: bool = True

  def __post_init__(self):
    if not callable(self.rule) and self.rule not in RULES:
      raise ValueError(f"rule must be one of {RULES} or a callable, got {self.rule!r}")

  @property
  def lossy(self) -> bool:
    if callable(self.rule):
      return not getattr(self.rule, "exact", False)
    return self.rule in verify.LOSSY_RULES


def is_lossy(drafter: Drafter, spec: SpecConfig) -> bool:
  """Whether sampled outputs may differ from the target's: a lossy rule, or a
  drafter whose q is not what its guesses were drawn from (greedy
  verification ignores q, so that is exact under a greedy target)."""
  return spec.lossy or (bool(drafter.lossy) and not spec.sampling.greedy)


def _write_block(history, length, block, n_emit):
  """history[b, length[b] + j] = block[b, j] for j < n_emit[b]."""
  b, w = block.shape
  cols = length[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
  cols = jnp.where(jnp.arange(w)[None] < n_emit[:, None], cols, history.shape[1])
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
  return history.at[rows, cols].set(block, mode="drop")


def _cut(block, n_block, remaining, eos_id):
  """Tokens of a block kept after EOS / the token limit: (B,) counts."""
  w = block.shape[1]
  j = jnp.arange(w)[None]
  is_eos = (block == eos_id) & (j < n_block[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, w)
  return jnp.minimum(jnp.minimum(n_block, first_eos), remaining)


def prefill(params, cfg: ModelConfig, drafter: Drafter, draft_params, keys, prompt_tokens,
            prompt_lengths, limit, *, num_slots: int, spec: SpecConfig, max_new_tokens: int,
            prompt_forwards: Optional[ar.PromptForwards] = None):
  """Target prefill + first token (`autoregressive.prefill`: the prompt forward
  is one program for every drafter and sampling setting with the same shapes
  and hidden layers; `prompt_forwards` shares its result with other runs of
  the same prompts), then the drafter's init. Returns the initial SpecState."""
  hidden_layers = tuple(drafter.layers_for(cfg)) if drafter.needs_prefill_hidden else None
  out = ar.prefill(params, cfg, keys, prompt_tokens, prompt_lengths, limit, num_slots=num_slots,
                   sampling=spec.sampling, max_new_tokens=max_new_tokens,
                   hidden_layers=hidden_layers, prompt_forwards=prompt_forwards)
  base, hidden = out if hidden_layers is not None else (out, None)
  return _start_state(params, cfg, drafter, draft_params, prompt_tokens, prompt_lengths, base,
                      hidden, num_slots=num_slots)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "num_slots"),
                   donate_argnames=("base",))
def _start_state(params, cfg: ModelConfig, drafter: Drafter, draft_params, prompt_tokens,
                 prompt_lengths, base: ar.DecodeState, hidden, *, num_slots: int):
  """The drafter's init around the target's prefilled state: the initial SpecState."""
  b, t = prompt_tokens.shape
  extra = {} if hidden is None else {"hidden": hidden}
  history = jnp.full((b, num_slots), cfg.pad_id, jnp.int32)
  history = history.at[:, :t].set(prompt_tokens)
  history = history.at[jnp.arange(b), prompt_lengths].set(base.last)
  dstate = drafter.init(draft_params, Target(params, cfg), prompt_tokens, prompt_lengths,
                        num_slots, **extra)
  k = drafter.k
  zeros = jnp.zeros((b,), jnp.int32)
  metrics = Metrics(rounds=zeros, emitted=zeros, proposed=zeros, accepted=zeros,
                    accept_hist=jnp.zeros((b, k + 1), jnp.int32),
                    reached=jnp.zeros((b, k), jnp.int32), kept=jnp.zeros((b, k), jnp.int32),
                    narrow=zeros, verified=zeros)
  # base.num_tokens is 1, or 0 on a row whose first token's logits were not finite
  return SpecState(round=jnp.zeros((), jnp.int32), cache=base.cache, drafter=dstate,
                   keys=base.keys, history=history, length=prompt_lengths + base.num_tokens,
                   prompt_len=prompt_lengths, num_tokens=base.num_tokens, limit=base.limit,
                   done=base.done, metrics=metrics, nonfinite_at=base.nonfinite_at)


def run_verify(spec: SpecConfig, num_proposed, verify_forward, cache, width: int,
               widths=()):
  """`verify_forward(cache, w)` at the narrowest w of `widths` (plus `width`,
  and 1 with `spec.narrow_verify`) that holds every row's proposal (num_proposed
  + 1 tokens; rows not active propose 0); verify_forward pads its outputs to
  `width`. -> (logits, hidden, cache, width used)."""
  ws = sorted({w for w in widths if 1 <= w < width} | {width}
              | ({1} if spec.narrow_verify else set()))
  if len(ws) == 1:
    return verify_forward(cache, width) + (jnp.int32(width),)
  need = jnp.max(num_proposed) + 1
  idx = jnp.minimum(jnp.sum(jnp.asarray(ws[:-1]) < need), len(ws) - 1)
  out = jax.lax.switch(idx, [lambda c, w=w: verify_forward(c, w) for w in ws], cache)
  return out + (jnp.asarray(ws, jnp.int32)[idx],)


def stop_nonfinite(state: SpecState, logits, num_valid) -> SpecState:
  """Active rows with NaN / inf among their first num_valid[b] verify logits
  (B, W, V) -- the positions that chose this round's tokens -- stop before
  this round emits (`autoregressive.note_nonfinite`)."""
  bad = ar.nonfinite_rows(logits, ~state.done, num_valid)
  nonfinite_at, done = ar.note_nonfinite(state.nonfinite_at, state.done, bad, state.num_tokens)
  return state.replace(nonfinite_at=nonfinite_at, done=done)


def propose_round(params, cfg: ModelConfig, drafter: Drafter, draft_params, spec: SpecConfig,
                  state: SpecState):
  """The start of a round, chain or tree: the drafter's proposal for every
  row from the committed history, with this round's drafting keys.
  -> (active rows, acceptance keys, proposal, drafter state, target cache)."""
  active = ~state.done
  ctx = Context(history=state.history, length=state.length, prompt_len=state.prompt_len,
                active=active)
  draft_keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, state.round)
  accept_keys = batch_lib.purpose_keys(state.keys, spec.accept_purpose, state.round)
  proposal, dstate, cache = drafter.propose(draft_params, Target(params, cfg), state.drafter,
                                            ctx, state.cache, draft_keys)
  return active, accept_keys, proposal, dstate, cache


def spec_round(params, cfg: ModelConfig, drafter: Drafter, draft_params, spec: SpecConfig,
               state: SpecState) -> SpecState:
  """One draft-verify-accept-commit round for every active row.

  A chain proposal (`proposal.parent is None`, K guesses) is verified at
  positions length - 1 .. length - 1 + K with the causal mask; a tree (N
  nodes, `specjax.trees`) at the root's position plus each node's depth, with
  an ancestor-only mask, and its accepted path's cache entries are then moved
  into place. The branch is taken at trace time; everything else is shared.
  """
  k = drafter.k  # a chain's guesses; a tree's depth (the longest path it holds)
  active, accept_keys, proposal, dstate, cache = propose_round(params, cfg, drafter,
                                                               draft_params, spec, state)
  is_tree = proposal.parent is not None
  width = proposal.tokens.shape[1] + 1  # the newest committed token, then K guesses / N nodes
  num_proposed = jnp.where(active, proposal.num_proposed, 0)
  # The fill level the verify forward starts from: whatever a cache-sharing
  # drafter wrote sits at slots >= length - 1, all of which this forward rewrites.
  root_slot = state.length - 1
  cache = cache.with_length(root_slot)
  last = jnp.take_along_axis(state.history, root_slot[:, None], axis=1)
  fed = jnp.concatenate([last, proposal.tokens], axis=1)  # (B, width)
  if is_tree:
    if spec.rule != "exact":
      raise ValueError(f"tree verification supports the exact rule only, got {spec.rule!r}")
    n_nodes = width - 1
    valid = (jnp.arange(n_nodes)[None] < num_proposed[:, None]) & (proposal.parent >= -1)
    parent = jnp.where(valid, proposal.parent, -1)  # for positions and the mask
    dep = trees.depths(parent)
    positions = root_slot[:, None] + jnp.concatenate([jnp.zeros_like(dep[:, :1]), dep], axis=1)
    # padding nodes: visible to nobody but themselves
    real = jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], axis=1)
    mask = trees.ancestor_mask(parent) & (real[:, None, :]
                                          | jnp.eye(width, dtype=bool)[None])
  else:
    positions = root_slot[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    mask = None
  hidden_layers = tuple(drafter.layers_for(cfg))

  def verify_forward(cache, w):
    logits, hidden, cache = transformer.forward(
        params, cfg, fed[:, :w], positions[:, :w], cache,
        mask=None if mask is None else mask[:, :w, :w], active=active,
        hidden_layers=hidden_layers)
    if w < width:  # positions past every row's proposal are never read
      logits, hidden = (jnp.pad(x, ((0, 0), (0, width - w), (0, 0)), mode="edge")
                        for x in (logits, hidden))
    return logits, hidden, cache

  logits, hidden, cache, used = run_verify(spec, num_proposed, verify_forward, cache, width,
                                           drafter.verify_widths)
  if is_tree:
    parent = jnp.where(valid, parent, -2)  # padding is nobody's child
    if spec.sampling.greedy:
      path, n_acc, nxt = verify.tree_greedy_accept(proposal.tokens, parent, logits,
                                                   num_proposed)
    else:
      p = sampling_lib.probs(logits, spec.sampling)
      path, n_acc, nxt = verify.tree_accept(accept_keys, proposal.tokens, parent, proposal.q,
                                            p, num_proposed)
    n_acc = jnp.minimum(n_acc, k)
    # the root's and the accepted path's logits chose this round's tokens
    state = stop_nonfinite(state, trees.path_gather(logits, path, k + 1), n_acc + 1)
    cache = trees.commit_path(cache, root_slot, path, n_acc, active)
    path_tokens = jnp.take_along_axis(proposal.tokens, jnp.maximum(path[:, :k], 0), axis=1)
    hidden = trees.path_gather(hidden, path, k + 1)
    evaluated = jnp.minimum(n_acc + 1, jnp.minimum(num_proposed, k))
  else:
    if callable(spec.rule):
      p = sampling_lib.probs(logits, spec.sampling)
      n_acc, nxt = spec.rule(accept_keys, proposal.tokens, proposal.q, p, num_proposed, logits)
    elif spec.rule == "typical":
      p = sampling_lib.probs(logits, spec.sampling)
      n_acc, nxt = verify.typical_accept(proposal.tokens, p, num_proposed)
    elif spec.sampling.greedy:
      n_acc, nxt = verify.greedy_accept(proposal.tokens, logits, num_proposed)
    else:
      p = sampling_lib.probs(logits, spec.sampling)
      n_acc, nxt = verify.chain_accept(accept_keys, proposal.tokens, proposal.q, p,
                                       num_proposed)
    # positions 0..n_acc chose this round's tokens (a NaN there may have been accepted through)
    state = stop_nonfinite(state, logits, n_acc + 1)
    path_tokens = proposal.tokens
    evaluated = jnp.minimum(n_acc + 1, num_proposed)
  return commit_round(cfg, drafter, draft_params, state, dstate, cache, path_tokens, n_acc,
                      nxt, hidden, evaluated, used)


def commit_round(cfg: ModelConfig, drafter: Drafter, draft_params, state: SpecState, dstate,
                 cache, path_tokens, n_acc, nxt, hidden, evaluated, width) -> SpecState:
  """The end of a round, chain or tree: emit the n_acc accepted tokens
  `path_tokens[:, :n_acc]` and `nxt`, cut at EOS and the token limit; set
  the target cache's fill level (its entries of the accepted tokens must sit
  in slots length - 1 + 1 .. already); bring the drafter to the committed
  state (`hidden` (B, K + 1, .): the verify features of the root and the
  accepted path); count metrics (`evaluated`: guesses evaluated per row)."""
  k = drafter.k
  active = ~state.done
  # The emitted block: accepted guesses then the next token, cut at EOS / limit.
  j = jnp.arange(k + 1)[None]
  block = jnp.where(j < n_acc[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))),
                    nxt[:, None])
  block = jnp.where(j <= n_acc[:, None], block, cfg.pad_id)
  n_emit = _cut(block, n_acc + 1, state.limit - state.num_tokens, cfg.eos_id)
  n_emit = jnp.where(active, n_emit, 0)
  history = _write_block(state.history, state.length, block, n_emit)
  length = state.length + n_emit
  num_tokens = state.num_tokens + n_emit
  hit_eos = jnp.any((block == cfg.eos_id) & (j < n_emit[:, None]), axis=1)
  done = state.done | (active & (hit_eos | (num_tokens >= state.limit)))
  # The target cache now holds history[:length - 1] on rows that continue.
  cache = cache.with_length(jnp.where(active, length - 1, state.cache.length))
  ctx_after = Context(history=history, length=length, prompt_len=state.prompt_len,
                      active=active)
  dstate = drafter.commit(draft_params, dstate, ctx_after,
                          VerifyOutput(hidden=hidden, num_accepted=jnp.where(active, n_acc, 0)))

  # Metrics (only what was emitted counts).
  m = state.metrics
  kept_guesses = jnp.minimum(n_acc, n_emit)
  evaluated = jnp.minimum(evaluated, n_emit)
  act = active.astype(jnp.int32)
  pos = jnp.arange(k)[None]
  metrics = Metrics(
      rounds=m.rounds + act,
      emitted=m.emitted + n_emit,
      proposed=m.proposed + evaluated,
      accepted=m.accepted + kept_guesses,
      accept_hist=m.accept_hist + act[:, None] * jax.nn.one_hot(kept_guesses, k + 1,
                                                                dtype=jnp.int32),
      reached=m.reached + (pos < evaluated[:, None]).astype(jnp.int32),
      kept=m.kept + (pos < kept_guesses[:, None]).astype(jnp.int32),
      narrow=m.narrow + act * (width == 1).astype(jnp.int32),
      verified=m.verified + act * width,
  )
  return state.replace(round=state.round + 1, cache=cache, drafter=dstate, history=history,
                       length=length, num_tokens=num_tokens, done=done, metrics=metrics)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "spec"),
                   donate_argnames=("state",))
def decode(params, cfg: ModelConfig, drafter: Drafter, draft_params, state: SpecState, *,
           spec: SpecConfig) -> SpecState:
  """Rounds on device until every row is done."""
  body = functools.partial(spec_round, params, cfg, drafter, draft_params, spec)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


@dataclasses.dataclass
class SpecResult(ar.GenerateResult):
  """GenerateResult plus acceptance metrics (summed over rows)."""

  lossy: bool = False

  @property
  def alpha(self) -> float:
    """Empirical acceptance rate: accepted / guesses evaluated."""
    p = self.stats["proposed"]
    return self.stats["accepted"] / p if p else float("nan")

  @property
  def tau(self) -> float:
    """Tokens per target decode forward (bonus included, prefill excluded)."""
    r = self.stats["rounds"]
    return self.stats["emitted"] / r if r else float("nan")


def _summarize(state: SpecState) -> dict:
  m = jax.device_get(state.metrics)
  return {
      "rounds": int(m.rounds.sum()),
      "emitted": int(m.emitted.sum()),
      "proposed": int(m.proposed.sum()),
      "accepted": int(m.accepted.sum()),
      "accept_hist": m.accept_hist.sum(0).tolist(),
      "per_position_acceptance": (m.kept.sum(0) / np.maximum(m.reached.sum(0), 1)).tolist(),
      "max_rounds_per_row": int(m.rounds.max()),
      "narrow_rounds": int(m.narrow.sum()),
      "verified_tokens": int(m.verified.sum()),
  }


def start(params, cfg: ModelConfig, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
          draft_params=None, key=0, spec: SpecConfig = SpecConfig(), max_new_tokens=64,
          request_ids=None, cache_slots: Optional[int] = None, mesh=None,
          width: Optional[int] = None,
          prompt_forwards: Optional[ar.PromptForwards] = None) -> SpecState:
  """Check the drafter, pad the prompts, derive per-request keys and prefill:
  the state `decode` starts from (also what calibration measures proposals on).
  With a `mesh`, params, inputs and the returned state are placed on it
  (`specjax.sharding`); a batch that does not divide its `data` axis is not
  split (`generate` pads it first)."""
  drafter.check(cfg, draft_params)
  tokens, lengths, limits, width, num_slots = ar.prepare(cfg, prompts, max_new_tokens,
                                                         max(drafter.k + 1, drafter.block),
                                                         cache_slots, width)
  keys = batch_lib.request_keys(batch_lib.as_key(key),
                                batch_lib.request_ids_for(len(prompts), request_ids))
  inputs = (keys, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(limits))
  if mesh is not None:
    params = sharding.place_params(params, mesh)
    draft_params = sharding.place_params(draft_params, mesh)
    inputs = sharding.place_batch(inputs, len(prompts), mesh)
  state = prefill(params, cfg, drafter, draft_params, *inputs, num_slots=num_slots, spec=spec,
                  max_new_tokens=width, prompt_forwards=prompt_forwards)
  if mesh is not None:  # the loop state as the loop will carry it
    state = sharding.place_batch(state, len(prompts), mesh)
  return state


def generate(params, cfg: ModelConfig, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
             draft_params=None, key=0, spec: SpecConfig = SpecConfig(), max_new_tokens=64,
             request_ids=None, cache_slots: Optional[int] = None, mesh=None,
             width: Optional[int] = None,
             prompt_forwards: Optional[ar.PromptForwards] = None) -> SpecResult:
  """Speculative generation for token-id prompts (ragged lengths allowed).

  The same arguments as `autoregressive.generate` (`width` and
  `prompt_forwards` included), plus the
  drafter, its params and the SpecConfig (target sampling settings and
  acceptance rule).
  Raises NonFiniteLogitsError as `autoregressive.generate` does.
  """
  n = len(prompts)
  if mesh is not None:
    prompts, max_new_tokens, request_ids = sharding.pad_requests(prompts, max_new_tokens,
                                                                 request_ids, mesh)
    params = sharding.place_params(params, mesh)
    draft_params = sharding.place_params(draft_params, mesh)
  t0 = time.perf_counter()
  state = start(params, cfg, drafter, prompts, draft_params=draft_params, key=key, spec=spec,
                max_new_tokens=max_new_tokens, request_ids=request_ids, cache_slots=cache_slots,
                mesh=mesh, width=width, prompt_forwards=prompt_forwards)
  num_slots = state.cache.num_slots
  state.num_tokens.block_until_ready()
  t1 = time.perf_counter()
  state = decode(params, cfg, drafter, draft_params, state, spec=spec)
  history, length, plen, nonfinite_at = jax.device_get((state.history, state.length,
                                                        state.prompt_len, state.nonfinite_at))
  t2 = time.perf_counter()
  out = [history[i, plen[i]:length[i]].tolist() for i in range(n)]
  result = SpecResult(tokens=out, prefill_s=t1 - t0, decode_s=t2 - t1, num_slots=num_slots,
                      stats=_summarize(state), lossy=is_lossy(drafter, spec))
  ar.raise_if_nonfinite(nonfinite_at[:n], result, "speculative decoding")
  return result
