"""The one drafter interface of the speculative loop.

A drafter is a frozen (hashable, jit-static) dataclass holding its static
settings; its weights (if any) travel separately as `params`, its per-request
state as a pytree. Each round the loop calls

    proposal, state, target_cache = drafter.propose(params, target, state, ctx, keys)

and, after verification,

    state = drafter.commit(params, state, ctx_after, num_accepted, verify)

`ctx` is the committed history the loop keeps for every row: all prompt and
emitted tokens and their count. Invariant: the target's cache holds the
keys/values of `history[:length - 1]`; the newest committed token
`history[length - 1]` has not been fed to the target yet (the verify forward
feeds it first, followed by the K guesses).

A drafter that keeps its own cache of the committed history (a draft model)
knows how many history tokens it has already consumed; whatever the last
round left it short of (the correction or bonus token, and after an all-accept
round its own last guess -- one or two tokens, a different number per row) it
feeds first, from `ctx.history`. Anything it wrote for rejected guesses is
discarded by lowering its own fill level to the agreed prefix in `commit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.models.cache import KVCache


@flax.struct.dataclass
class Context:
  """What the loop offers a drafter each round (one row per request)."""

  history: jax.Array  # (B, H) int32 committed tokens: prompt then emitted
  length: jax.Array  # (B,) int32 committed tokens per row
  prompt_len: jax.Array  # (B,) int32 prompt tokens per row
  active: jax.Array  # (B,) bool rows still generating


@flax.struct.dataclass
class Proposal:
  """A drafter's guesses per row and the distributions they were drawn from.

  A chain (`parent` None): up to K guesses, guess i following guess i - 1.
  A tree (`parent` given): up to N nodes in topological order, siblings in
  draw order; node j's parent is `parent[b, j]` in [-1, j - 1] (-1: the root,
  the newest committed token), and -2 marks a node that is not in the tree (a
  duplicate a trie merged away, an empty candidate slot:
  `specjax.trees.candidates_tree`). Entries at or beyond `num_proposed[b]` are
  padding: never accepted (for a chain, the next token there is drawn from
  the target's p). Node / guess j was drawn from `q[:, j]` (for a tree, given
  the siblings drawn before it; see `specjax.verify`); deterministic drafters
  (prompt lookup, Lookahead, replay) give the one-hot of the guess.
  """

  tokens: jax.Array  # (B, K) or (B, N) int32
  q: jax.Array  # (B, K, V) or (B, N, V) float32
  num_proposed: jax.Array  # (B,) int32 in [0, K] or [0, N]
  parent: Optional[jax.Array] = None  # (B, N) int32 for a tree; None for a chain


@flax.struct.dataclass
class VerifyOutput:
  """What the target's verify forward produced, for drafters that learn from it."""

  hidden: jax.Array  # (B, K + 1, D) target hidden states at the fed positions
  num_accepted: jax.Array  # (B,) int32


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
                 stop_below: float = 0.0):
  """Autoregressive drafting of up to k tokens.

  `step(carry, tokens (B,)) -> (logits (B, V), carry)` feeds one token per row.
  Token i is drawn from q_i = probs(logits_i, sampling) with key
  fold_in(keys[b], i) -- or by `draw(logits, i) -> (tokens (B,), q (B, V))`
  when given (a drafter whose logits cover a sub-vocabulary); the last token
  is sampled but not fed (the verify forward feeds it).

  `stop_below` > 0: a dynamic draft length per row (EAGLE-2's confidence,
  SpecDec++'s stopping rule in its simplest form): a row drafts token i + 1
  only while the product of its confidences (`draft_confidence`) in tokens
  0..i is at least `stop_below`; drafting ends when no active row goes on.
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
  if stop_below > 0:
    return _chain_until_unsure(step, carry, first_logits, x0, q0, draw, k, sampling, active,
                               stop_below)

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
                        stop_below):
  b, v = q0.shape
  tokens = jnp.zeros((b, k), jnp.int32).at[:, 0].set(x0)
  qs = jnp.zeros((b, k, v), q0.dtype).at[:, 0].set(q0)
  cum = draft_confidence(first_logits, x0, q0, sampling)
  going = cum >= stop_below  # rows that draft the next token

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
    return i + 1, carry, x, tokens, qs, cum, num, going & (cum >= stop_below)

  init = (jnp.int32(1), carry, x0, tokens, qs, cum, jnp.ones((b,), jnp.int32), going)
  _, carry, _, tokens, qs, _, num, _ = jax.lax.while_loop(cond, body, init)
  return tokens, qs, carry, num


def check_stop_below(name: str, stop_below) -> None:
  if not isinstance(stop_below, (int, float)) or not 0.0 <= stop_below < 1.0:
    raise ValueError(f"{name}: stop_below (the dynamic draft length's confidence threshold) "
                     f"must lie in [0, 1), got {stop_below!r}")


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
  import numpy as np  # pylint: disable=import-outside-toplevel
  if rank is None:
    raise ValueError("draft_vocab=N needs a token ranking (the checkpoint's 'vocab_rank'); "
                     "this drafter has none: use 'full' or its own vocabulary")
  rank = np.asarray(rank)
  if within is not None:
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


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class: static settings; subclasses implement the four methods."""

  k: int

  def __post_init__(self):
    if not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f"draft length k must be an integer >= 1, got {self.k!r}")

  # Whether `propose` returns a tree (a `Proposal` with `parent`); k is then
  # the tree's depth and `block` its node count + 1.
  tree = False
  name = "drafter"
  # Whether the drafter's q is NOT the distribution its guesses were drawn
  # from (a lossy opt-in such as the fixed-top-k trees' 'topk_q'): sampled
  # outputs then differ from the target's; results carry `lossy`.
  lossy = False
  # Whether `init` needs the target's prefill hidden states (`hidden=`, the
  # layers `layers_for` names): feature-level drafters (EAGLE).
  needs_prefill_hidden = False

  def layers_for(self, target_cfg) -> tuple:
    """`hidden_layers` the target's forwards return for this drafter (`VerifyOutput.hidden`);
    () is the final normed hidden state."""
    return ()

  @property
  def block(self) -> int:
    """Cache slots past the committed prefix a round may write (verify: k + 1)."""
    return self.k + 1

  @property
  def verify_width(self) -> int:
    """Tokens the verify forward feeds: k + 1 for a chain, N + 1 for a tree of N nodes."""
    return self.num_nodes + 1 if self.tree else self.k + 1

  @property
  def verify_widths(self) -> tuple:
    """Verify widths the loop may choose from each round: the narrowest that
    holds every active row's proposal (plus 1 token when none proposed, with
    `SpecConfig.narrow_verify`). One width by default; a chain with a dynamic
    draft length (`stop_below` > 0) offers every width 2..k + 1 (each is one
    more compiled forward)."""
    if not self.tree and getattr(self, "stop_below", 0) > 0:
      return tuple(range(2, self.k + 2))
    return (self.verify_width,)

  @property
  def vocab_size(self) -> Optional[int]:
    """The drafter's vocabulary size, if it has one (checked against the target)."""
    return None

  def check(self, target_cfg, params) -> None:
    """Raise a clear error if the drafter cannot serve this target."""
    v = self.vocab_size
    if v is not None and v != target_cfg.vocab_size:
      raise ValueError(
          f"{self.name}: draft vocabulary ({v}) differs from the target's "
          f"({target_cfg.vocab_size}); speculative decoding needs a shared vocabulary")

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots: int) -> Any:
    """Per-request state after the prompt (e.g. a prefilled draft cache).
    Drafters with `needs_prefill_hidden` also get `hidden=` (B, T, Df)."""
    return ()

  def propose(self, params, target, state, ctx: Context, target_cache: KVCache,
              keys: jax.Array):
    """-> (Proposal, state, target_cache)."""
    raise NotImplementedError

  def commit(self, params, state, ctx: Context, verify: VerifyOutput) -> Any:
    """Bring the state to the committed history `ctx` (after verification)."""
    return state


@flax.struct.dataclass
class Target:
  """The target model as the loop hands it to drafters: params + static cfg."""

  params: Any
  cfg: Any = flax.struct.field(pytree_node=False)
