"""Engine probes: a replay drafter (alpha = 1 under greedy) and an alpha = 0 control.

`Replay` proposes the tokens of a previous run (e.g. the AR greedy output of
the same prompt), so under greedy every guess is accepted and each round emits
k + 1 tokens: how close the loop comes to the ideal (k + 1) * t_AR / t_verify
measures the engine's own overhead. `AlwaysReject` proposes a fixed token that
the target practically never emits, showing what a useless drafter costs.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import one_hot_q


@flax.struct.dataclass
class ReplayParams:
  tokens: jax.Array  # (B, R) the reference continuation of each row (after the prompt)
  length: jax.Array  # (B,) valid reference tokens per row


def replay_params(continuations, pad_id: int = 0) -> ReplayParams:
  import numpy as np  # pylint: disable=import-outside-toplevel
  width = max(1, max(len(c) for c in continuations))
  arr = np.full((len(continuations), width), pad_id, np.int32)
  for i, c in enumerate(continuations):
    arr[i, :len(c)] = c
  return ReplayParams(jnp.asarray(arr), jnp.asarray([len(c) for c in continuations], jnp.int32))


@dataclasses.dataclass(frozen=True)
class Replay(Drafter):
  name = "replay"

  def check(self, target_cfg, params) -> None:
    if params is None:
      raise ValueError("replay: the reference tokens were not given (draft_params)")

  def draft(self, params, target, state, ctx, keys):
    if params.tokens.shape[0] != ctx.length.shape[0]:  # static shapes: raised while tracing
      raise ValueError(f"replay: {params.tokens.shape[0]} reference continuations for a batch "
                       f"of {ctx.length.shape[0]} rows; give one per prompt (and per padding "
                       "row on a mesh: sharding.pad_requests)")
    done = ctx.length - ctx.prompt_len  # tokens generated so far
    idx = jnp.minimum(done[:, None] + jnp.arange(self.k)[None], params.tokens.shape[1] - 1)
    tokens = jnp.take_along_axis(params.tokens, idx, axis=1)
    num = jnp.where(ctx.active, jnp.clip(params.length - done, 0, self.k), 0).astype(jnp.int32)
    return (Proposal(tokens=tokens, q=one_hot_q(tokens, target.cfg.vocab_size),
                     num_proposed=num), state)


@dataclasses.dataclass(frozen=True)
class AlwaysReject(Drafter):
  token: int = 0
  name = "always_reject"

  def draft(self, params, target, state, ctx, keys):
    b = ctx.length.shape[0]
    tokens = jnp.full((b, self.k), self.token, jnp.int32)
    num = jnp.where(ctx.active, self.k, 0).astype(jnp.int32)
    return (Proposal(tokens=tokens, q=one_hot_q(tokens, target.cfg.vocab_size),
                     num_proposed=num), state)
