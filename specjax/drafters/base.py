"""The one drafter interface of the speculative loop.

A drafter is a frozen (hashable, jit-static) dataclass holding its static
settings; its weights (if any) travel separately as `params`, its per-request
state as a pytree. Each round the loop calls

    proposal, state = drafter.draft(params, target, state, ctx, keys)

(through `propose`, below) and, after verification (`verify` carries the accepted count and the
target's hidden states at the fed positions),

    state = drafter.commit(params, state, ctx_after, verify)

`ctx` is the committed history the loop keeps for every row: all prompt and
emitted tokens and their count. Invariant: the target's cache holds the
keys/values of `history[:length - 1]`; the newest committed token
`history[length - 1]` has not been fed to the target yet (the verify forward
feeds it first, followed by the K guesses). The loop alone sets the target
cache's fill level: before verification (to length - 1) and at commit.

Self-speculative drafters (layer skip, Lookahead) run the target's own layers
on their guesses, writing keys/values into the target's cache above its fill
level, where the verify forward rewrites them. They override the loop's call
itself,

    proposal, state, target_cache = drafter.propose(params, target, state, ctx,
                                                    target_cache, keys)

returning the cache they wrote into (so XLA updates it in place instead of
copying it); every other drafter implements `draft` and never sees the cache.

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


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Base class: static settings; subclasses implement the four methods."""

  k: int

  def __post_init__(self):
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
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
  # Whether the drafter's state keeps what it computed for its own guesses and
  # `commit` takes the accepted ones for its own (a draft model's cache): it
  # cannot share a round with other drafters (`specjax.drafters.union`).
  keeps_own_guesses = False

  def layers_for(self, target_cfg) -> tuple:
    """`hidden_layers` the target's forwards return for this drafter (`VerifyOutput.hidden`);
    () is the final normed hidden state."""
    return ()

  @property
  def block(self) -> int:
    """Cache slots past the committed prefix a round may write (verify: k + 1)."""
    return self.k + 1

  @property
  def num_nodes(self) -> int:
    """Guesses a round proposes at most: k for a chain; a tree's node count
    (trees override it)."""
    return self.k

  @property
  def verify_width(self) -> int:
    """Tokens the verify forward feeds: the newest committed token + the guesses."""
    return self.num_nodes + 1

  @property
  def verify_widths(self) -> tuple:
    """Verify widths the loop may choose from each round: the narrowest that
    holds every active row's proposal (plus 1 token when none proposed, with
    `SpecConfig.narrow_verify`). One width by default; a chain with a dynamic
    draft length offers more (`specjax.drafters.chain.chain_widths`; each is
    one more compiled forward)."""
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

  def draft(self, params, target, state, ctx: Context, keys: jax.Array):
    """This round's guesses for every row of `ctx` -> (Proposal, state)."""
    raise NotImplementedError

  def propose(self, params, target, state, ctx: Context, target_cache: KVCache,
              keys: jax.Array):
    """The loop's call -> (Proposal, state, target_cache): `draft`, the
    target's cache passed through untouched. Only drafters that write into the
    target's cache (see the module docstring) override it."""
    proposal, state = self.draft(params, target, state, ctx, keys)
    return proposal, state, target_cache

  def commit(self, params, state, ctx: Context, verify: VerifyOutput) -> Any:
    """Bring the state to the committed history `ctx` (after verification)."""
    return state


@flax.struct.dataclass
class Target:
  """The target model as the loop hands it to drafters: params + static cfg."""

  params: Any
  cfg: Any = flax.struct.field(pytree_node=False)
