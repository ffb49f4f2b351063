"""Medusa-1 heads (Cai et al. 2024, arXiv:2401.10774) and blockwise parallel
decoding (Stern et al. 2018, arXiv:1811.03115) on a frozen target.

Head i (i = 0 .. H-1) reads the target's final normed hidden state h_t at the
newest fed position -- the state whose LM-head output gives the next token
x_{t+1} -- and predicts the token i + 1 places beyond it, x_{t+2+i}:

    logits_i = LMHead_target(h_t + SiLU(W_i h_t + b_i))

The LM head is the target's own (frozen, not stored with the heads); W_i is
zero-initialised so an untrained head starts as the target's next-token
prediction. Parameters: {"w": (H, D, D) (out, in), "b": (H, D)}.

Decoding (a chain of the first k heads): the verify forward returns the
hidden state at every fed position; after accepting n guesses the next token
was drawn from position n's logits, so h at position n is the feature for
the next round. Until the first verify there is no feature: the first round
proposes nothing (the loop then verifies one token, which yields it).

* `Medusa`: guess i is drawn from q_i = probs(logits_i, sampling) (argmax
  when greedy); q_i is exactly what the guess was drawn from, so chain
  rejection sampling keeps the target's distribution at any temperature.
* `Blockwise`: Stern et al.'s predict-verify-accept -- the heads' top-1 chain,
  a deterministic drafter (one-hot q). Under greedy verification this is the
  paper's algorithm; with a sampling target the one-hot rule keeps it exact.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Drafter, Proposal, cut_at_eos, one_hot_q
from specjax.models import transformer


def init_heads(key: jax.Array, num_heads: int, dim: int, dtype=jnp.float32) -> dict:
  """Zero-initialised residual heads (each starts as the identity)."""
  del key  # deterministic init; kept for a uniform init signature
  return {"w": jnp.zeros((num_heads, dim, dim), dtype), "b": jnp.zeros((num_heads, dim), dtype)}


def head_states(heads: dict, h: jax.Array, num: int | None = None) -> jax.Array:
  """h (..., D) -> (..., H, D): each head's residual block applied to h."""
  w, b = heads["w"], heads["b"]
  if num is not None:
    w, b = w[:num], b[:num]
  z = jnp.einsum("...d,hfd->...hf", h.astype(jnp.float32), w.astype(jnp.float32),
                 preferred_element_type=jnp.float32) + b.astype(jnp.float32)
  return h[..., None, :].astype(jnp.float32) + jax.nn.silu(z)


def head_logits(heads: dict, target_params, target_cfg, h: jax.Array,
                num: int | None = None) -> jax.Array:
  """(..., D) -> (..., H, V) float32 logits through the target's LM head."""
  return transformer.lm_head(target_params, target_cfg, head_states(heads, h, num))


@flax.struct.dataclass
class MedusaState:
  feature: jax.Array  # (B, D) target hidden at the newest fed position
  valid: jax.Array  # (B,) bool: a feature exists (false until the first verify)


@dataclasses.dataclass(frozen=True)
class Medusa(Drafter):
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  name = "medusa"

  def check(self, target_cfg, params) -> None:
    if params is None or "w" not in params:
      raise ValueError(f"{self.name}: needs trained heads (params with 'w' and 'b'); "
                       "load a checkpoint or train one with experiments/train.py")
    h, d, _ = params["w"].shape
    if d != target_cfg.dim:
      raise ValueError(f"{self.name}: heads of width {d} cannot read a target of width "
                       f"{target_cfg.dim}")
    if self.k > h:
      raise ValueError(f"{self.name}: k={self.k} needs {self.k} heads, the checkpoint has {h}")

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots):
    b = prompt_tokens.shape[0]
    return MedusaState(feature=jnp.zeros((b, target.cfg.dim), jnp.float32),
                       valid=jnp.zeros((b,), bool))

  def _guesses(self, logits, keys):
    q = sampling_lib.probs(logits, self.sampling)  # (B, k, V)
    if self.sampling.greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), q
    sub = jax.vmap(lambda kk: jax.vmap(lambda i: jax.random.fold_in(kk, i))(
        jnp.arange(self.k)))(keys)  # (B, k) keys
    x = jax.vmap(jax.vmap(sampling_lib.sample_from_probs))(sub, q)
    return x.astype(jnp.int32), q

  def propose(self, params, target, state, ctx, target_cache, keys):
    logits = head_logits(params, target.params, target.cfg, state.feature, self.k)  # (B, k, V)
    tokens, q = self._guesses(logits, keys)
    num = jnp.where(state.valid & ctx.active, self.k, 0).astype(jnp.int32)
    num = cut_at_eos(tokens, num, target.cfg.eos_id)
    return Proposal(tokens=tokens, q=q, num_proposed=num), state, target_cache

  def commit(self, params, state, ctx, verify):
    n = verify.num_accepted
    feat = jnp.take_along_axis(verify.hidden, n[:, None, None], axis=1)[:, 0]
    return MedusaState(feature=jnp.where(ctx.active[:, None], feat.astype(jnp.float32),
                                         state.feature),
                       valid=state.valid | ctx.active)


@dataclasses.dataclass(frozen=True)
class Blockwise(Medusa):
  """Blockwise parallel decoding: the heads' top-1 chain, one-hot q."""

  deterministic = True
  name = "blockwise"

  def _guesses(self, logits, keys):
    x = jnp.argmax(logits, -1).astype(jnp.int32)
    return x, one_hot_q(x, logits.shape[-1])
