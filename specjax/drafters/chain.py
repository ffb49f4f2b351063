"""Helpers for drafters that propose chains: autoregressive drafting with a
dynamic draft length (`sample_chain`), one draw from draft logits over a full
or reduced draft vocabulary (`draw_from`, `ranked_vocab`, `parse_draft_vocab`),
the EOS cut, one-hot q for deterministic guesses. The contract itself is in
`specjax.drafters.base`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib


def one_hot_q(tokens: jax.Array, vocab_size: int) -> jax.Array:
  return jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32)


def cut_at_eos(tokens: jax.Array, num_proposed: jax.Array, eos_id: int) -> jax.Array:
  """Guesses after a drafted EOS are pointless: shorten the proposal to end there."""
  k = tokens.shape[1]
  is_eos = (tokens == eos_id) & (jnp.arange(k)[None] < num_proposed[:, None])
  first = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, k)
  return jnp.minimum(num_proposed, first)


def draft_confidence(logits, x, q, sampling):
  """The drafter's confidence in its guess x (B,): the probability it gave x
  -- q(x) when sampling; under greedy drafting (one-hot q) the T = 1 softmax
  probability of the argmax, from the logits (any sub-vocabulary)."""
  if sampling.greedy:
    lg = logits.astype(jnp.float32)
    return jnp.exp(jnp.max(lg, axis=-1) - jax.nn.logsumexp(lg, axis=-1))
  return jnp.take_along_axis(q, x[:, None], axis=-1)[:, 0]


def sample_chain(step, carry, first_logits, keys, k: int, sampling, active, draw=None,
                 draft_stop: float = 0.0):
  """Autoregressive drafting of up to k tokens.

  `step(carry, tokens (B,)) -> (logits (B, V), carry)` feeds one token per row.
  Token i is drawn from q_i = probs(logits_i, sampling) with key
  fold_in(keys[b], i) -- or by `draw(logits, i) -> (tokens (B,), q (B, V))`
  when given (a drafter whose logits cover a sub-vocabulary); the last token
  is sampled but not fed (the verify forward feeds it).

  `draft_stop` > 0: a dynamic draft length per row (EAGLE-2's confidence,
  SpecDec++'s stopping rule in its simplest form): a row drafts token i + 1
  only while the product of its confidences (`draft_confidence`) in tokens
  0..i is at least `draft_stop`; drafting ends when no active row goes on.
  Exact for sampled drafts: whether token i + 1 is drafted is decided before
  it is drawn, from the tokens above it only, never from its own value.

  Returns (tokens (B, k), q (B, k, V), carry, num (B,) tokens drafted per
  row; entries at or beyond num are padding).
  """
  def default_draw(logits, i):
    return draw_from(logits, sampling, keys, i)

  draw = draw or default_draw

  x0, q0 = draw(first_logits, 0)
  b = x0.shape[0]
  if draft_stop > 0:
    return _chain_until_unsure(step, carry, first_logits, x0, q0, draw, k, sampling, active,
                               draft_stop)

  def body(c, i):
    carry, x = c
    logits, carry = step(carry, x)
    x_next, q = draw(logits, i)
    return (carry, x_next), (x_next, q)

  if k == 2:
    (carry, _), (xs, qs) = _one_step_in_a_loop(body, (carry, x0))
  else:
    (carry, _), (xs, qs) = jax.lax.scan(body, (carry, x0), jnp.arange(1, k))
  tokens = jnp.concatenate([x0[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
  q = jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  return tokens, q, carry, jnp.full((b,), k, jnp.int32)


def _one_step_in_a_loop(body, init):
  """scan(body, init, [1]) kept a loop. XLA inlines a loop of one trip, and on
  CPU a drafting step inlined into the decode loop's body compiles to much
  slower code than the same step inside a loop of its own (measured: k = 2
  drafting with the distilled draft model cost 55 ms against 18 ms for k = 3).
  The trip count goes through an optimization barrier, so XLA cannot see it."""
  out_shapes = jax.eval_shape(lambda c: body(c, jnp.int32(1))[1], init)
  outs = jax.tree.map(lambda s: jnp.zeros((1,) + s.shape, s.dtype), out_shapes)
  trips = jax.lax.optimization_barrier(jnp.int32(1))

  def loop_body(j, state):
    c, acc = state
    c, y = body(c, j + 1)
    return c, jax.tree.map(lambda a, v: a.at[j].set(v), acc, y)

  return jax.lax.fori_loop(0, trips, loop_body, (init, outs))


def _chain_until_unsure(step, carry, first_logits, x0, q0, draw, k, sampling, active,
                        draft_stop):
  b, v = q0.shape
  tokens = jnp.zeros((b, k), jnp.int32).at[:, 0].set(x0)
  qs = jnp.zeros((b, k, v), q0.dtype).at[:, 0].set(q0)
  cum = draft_confidence(first_logits, x0, q0, sampling)
  going = cum >= draft_stop  # rows that draft the next token

  def cond(s):
    i, _, _, _, _, _, _, going = s
    return (i < k) & jnp.any(going & active)

  def body(s):
    i, carry, x_prev, tokens, qs, cum, num, going = s
    logits, carry = step(carry, x_prev)
    x, q = draw(logits, i)
    tokens = tokens.at[:, i].set(x)
    qs = qs.at[:, i].set(q)
    num = jnp.where(going, i + 1, num)
    cum = cum * draft_confidence(logits, x, q, sampling)
    return i + 1, carry, x, tokens, qs, cum, num, going & (cum >= draft_stop)

  init = (jnp.int32(1), carry, x0, tokens, qs, cum, jnp.ones((b,), jnp.int32), going)
  _, carry, _, tokens, qs, _, num, _ = jax.lax.while_loop(cond, body, init)
  return tokens, qs, carry, num


def chain_widths(k: int, draft_stop: float) -> tuple:
  """Verify widths of a chain drafter: k + 1, or with a dynamic draft length
  (`draft_stop` > 0) every width 2..k + 1."""
  return tuple(range(2, k + 2)) if draft_stop > 0 else (k + 1,)


def check_draft_stop(name: str, draft_stop) -> None:
  if not isinstance(draft_stop, (int, float)) or not 0.0 <= draft_stop < 1.0:
    raise ValueError(f"{name}: draft_stop (the dynamic draft length's confidence threshold) "
                     f"must lie in [0, 1), got {draft_stop!r}")


def parse_draft_vocab(draft_vocab, cfg):
  """A draft-vocabulary choice: None or '' (keep the drafter's own), 'full',
  or a number of tokens N in [1, V] (-> int)."""
  if draft_vocab is None or draft_vocab == "":
    return None
  if str(draft_vocab) == "full":
    return "full"
  try:
    n = int(draft_vocab)
  except (TypeError, ValueError):
    raise ValueError(f"draft_vocab must be 'full' or a number of tokens, got {draft_vocab!r}") \
        from None
  if not 1 <= n <= cfg.vocab_size:
    raise ValueError(f"draft_vocab={n}: must lie in [1, {cfg.vocab_size}]")
  return n


def ranked_vocab(rank, n: int, cfg, within=None) -> jax.Array:
  """The n first tokens of `rank` (most frequent first), restricted to
  `within` (a vocabulary the drafter was trained on can only be narrowed),
  EOS always included; sorted ids."""
  if rank is None:
    raise ValueError("draft_vocab=N needs a token ranking (the checkpoint's 'vocab_rank'); "
                     "this drafter has none: use 'full' or its own vocabulary")
  rank = np.asarray(rank)
  if within is not None:
    if n > len(within):  # more tokens than the drafter's head has rows
      raise ValueError(f"draft_vocab={n}: this drafter was trained on {len(within)} tokens and "
                       "its vocabulary can only be narrowed ('full' or at most "
                       f"{len(within)})")
    rank = rank[np.isin(rank, np.asarray(within))]
  keep = [int(x) for x in rank[:n]]
  if cfg.eos_id >= 0 and cfg.eos_id not in keep:
    keep = keep[:max(n - 1, 0)] + [cfg.eos_id]
  return jnp.asarray(np.sort(np.asarray(keep, np.int32)))


def draw_from(logits, sampling, keys, i, vocab=None, vocab_size: Optional[int] = None):
  """One guess per row from draft logits (B, V) -> (x (B,), q (B, V)), as
  `sample_chain` draws its i-th token. With `vocab` (Vd,) the logits cover
  only those token ids (a reduced draft vocabulary): the guess is mapped back
  to its id and q is scattered into the full vocabulary (zero elsewhere, so
  it is exactly the distribution the guess was drawn from)."""
  q_sub = sampling_lib.probs(logits, sampling)
  if sampling.greedy:
    j = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    sub = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
    j = jax.vmap(sampling_lib.sample_from_probs)(sub, q_sub)
  if vocab is None:
    return j, q_sub
  q = jnp.zeros((logits.shape[0], vocab_size), jnp.float32).at[:, vocab].set(q_sub)
  return vocab[j], q
