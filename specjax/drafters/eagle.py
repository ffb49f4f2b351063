"""EAGLE (Li et al. 2024, arXiv:2401.15077) and EAGLE-3 (arXiv:2503.01840)
feature-level drafting heads on a frozen target.

The head is one decoder layer (the target's layer shape) that autoregresses
at the feature level. Its input at position j is the pair

    u_j = FC([g_j ; emb(x_{j+1})])          (2D -> D)

where emb is the target's frozen embedding and g_j a feature of position j:

* EAGLE: g_j = f_j, the target's final normed hidden state at j (the state
  whose LM-head output predicts x_{j+1}); the head's output a_j regresses
  f_{j+1}, and logits = LMHead_target(a_j) predict x_{j+2}.
* EAGLE-3: g_j = Fuse([n(l_j) ; n(m_j) ; n(h_j)]) (3D -> D), low / middle /
  high layer outputs of the target (n: parameter-free RMS normalisation);
  no feature regression: logits = LMHead(RMSNorm(a_j)).

While drafting, positions past the committed prefix have no target feature:
the head feeds its own output a_{j-1} as g_j (for EAGLE-3 in place of the
fused feature, as in its training-time test).

Reduced draft vocabulary (optional, params["vocab"]: (Vd,) int32 token ids,
the most frequent target tokens): the draft logits are computed only for
those tokens through the matching rows of the target's LM head, and q is
zero elsewhere. q is still exactly what each guess was drawn from, so the
chain rule stays exact; only acceptance can suffer. On SmolLM2 the 49152-row
LM head dominates every draft step.

The head may stack several such layers (`init_head(..., num_layers=n)`:
params "layer", "layer_1", ..., "layer_{n-1}", applied in that order; one
layer is the papers' head and every checkpoint before this option).

Decoding keeps a KV cache (one entry per head layer) of the committed history. Invariant
(after `commit`): the head's cache holds the pairs of positions
0 .. m-1 built from the target's true features; `pending` holds the target's
features of positions m .. m + count - 1 (from the last verify forward, or
the prefill), whose pairs are fed at the start of the next `propose` together
with the committed tokens x_{j+1} -- so the entries written for accepted
positions during drafting (from the head's own features) are rewritten from
the target's true features, and the bonus token, which has no feature yet,
is only ever the token half of a pair. The drafted chain's own entries are
dropped in `commit` by lowering the fill level.

Params: {"fc": (D, 2D), "layer": {attn_norm, wqkv, wo, mlp_norm, w_gate_up,
w_down} (one target-shaped layer), "layer_1" ... (further layers, optional),
"norm": (D,) (EAGLE-3), "fuse": (D, 3D) (EAGLE-3), "vocab": (Vd,) (optional)}.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import (chain_widths, check_draft_stop, cut_at_eos, draw_from,
                                    parse_draft_vocab, ranked_vocab, sample_chain)
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

# The target's own building blocks (a head layer is a target-shaped layer).
_dot = transformer._dot  # pylint: disable=protected-access
_write = transformer._write  # pylint: disable=protected-access
_attention = transformer._attention  # pylint: disable=protected-access


def shared_dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w^T as one XLA dot, float32 accumulation, whatever the row count: for
  a weight that several products of one program read (a tree's depths).
  `_dot`'s multiply + reduction form for 2-16 rows is the faster one for a
  weight read once, but XLA CPU shares the broadcast weight between identical
  products and materialises it ((F, rows, D) floats: 75 MB for the 8,192-row
  draft LM head at 4 rows, rebuilt every round), which made a depth-4 EAGLE-2
  tree's drafting cost ~12x a k = 2 chain's."""
  return jnp.einsum("...d,fd->...f", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def eagle3_layers(cfg: ModelConfig) -> Tuple[int, int, int]:
  """Low / middle / high target layers EAGLE-3 fuses (outputs of these layers)."""
  n = cfg.num_layers
  return (min(2, n - 1), n // 2, max(n - 3, 0))


def layer_names(num_layers: int) -> Tuple[str, ...]:
  """The params keys of a head's layers, in order ("layer" first: a one-layer
  head is the papers' and every earlier checkpoint's)."""
  return ("layer",) + tuple(f"layer_{i}" for i in range(1, num_layers))


def head_layers(head: dict) -> Tuple[dict, ...]:
  """The head's decoder layers, in the order they run."""
  n = 1
  while f"layer_{n}" in head:
    n += 1
  return tuple(head[name] for name in layer_names(n))


def head_config(cfg: ModelConfig, num_layers: int = 1) -> ModelConfig:
  """The head's config: the target's layer shape, `num_layers` of them."""
  return cfg.replace(num_layers=num_layers)


def init_head(key: jax.Array, cfg: ModelConfig, *, fused: bool,
              vocab: Optional[jax.Array] = None, num_layers: int = 1) -> dict:
  """Random head (float32): `num_layers` fresh target-shaped layers, FC near [I, 0]."""
  if num_layers < 1:
    raise ValueError(f"an EAGLE head needs at least one layer, got num_layers={num_layers}")
  d = cfg.dim
  k_layer, k_fc, k_fuse = jax.random.split(key, 3)
  p = {}
  for i, name in enumerate(layer_names(num_layers)):
    # layer 0 draws from k_layer itself: a one-layer head is the same as before
    k_i = k_layer if i == 0 else jax.random.fold_in(k_layer, i)
    layer = transformer.init(k_i, head_config(cfg).replace(dtype="float32"))["layers"][0]
    # The output projections start small: the head starts close to "the next
    # feature is this one" and learns the residual.
    layer["wo"] = layer["wo"] * 0.1
    layer["w_down"] = layer["w_down"] * 0.1
    p[name] = layer
  fc = jnp.concatenate([jnp.eye(d), jax.random.normal(k_fc, (d, d)) * 0.02 / jnp.sqrt(d)], 1)
  p = {"fc": fc.astype(jnp.float32), **p}
  if fused:
    eye3 = jnp.concatenate([jnp.eye(d) / 3] * 3, axis=1)
    p["fuse"] = (eye3 + jax.random.normal(k_fuse, (d, 3 * d)) * 0.01 / jnp.sqrt(d)).astype(
        jnp.float32)
    p["norm"] = jnp.ones((d,), jnp.float32)
  if vocab is not None:
    p["vocab"] = jnp.asarray(vocab, jnp.int32)
  return p


def init_head_from_target(key: jax.Array, cfg: ModelConfig, target_params, layer: int, *,
                          fused: bool, vocab: Optional[jax.Array] = None,
                          num_layers: int = 1) -> dict:
  """A head that starts as one of the target's own layers (float32).

  The head's layer is a copy of target layer `layer` (a negative index counts
  from the end) and, for EAGLE-3, its output norm the target's final norm and
  the fusion a pass-through of the high tapped layer: at step 0 the head runs
  the target's late computation on the target's late features, so training
  starts from attention and MLP weights that already read this feature space
  instead of from noise. The FC keeps `init_head`'s [I, ~0] (the token
  embedding enters as it learns). Further layers (`num_layers` > 1) stay random."""
  n = cfg.num_layers
  if not -n <= layer < n:
    raise ValueError(f"head_init_layer={layer}: the target has {n} layers (0..{n - 1}, or "
                     f"-{n}..-1 from the end)")
  p = init_head(key, cfg, fused=fused, vocab=vocab, num_layers=num_layers)
  p["layer"] = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                            dict(target_params["layers"][layer]))
  if fused:
    d = cfg.dim
    k_fuse = jax.random.fold_in(key, 1)
    high = jnp.concatenate([jnp.zeros((d, 2 * d)), jnp.eye(d)], axis=1)
    p["fuse"] = (high + jax.random.normal(k_fuse, (d, 3 * d)) * 0.01 / jnp.sqrt(d)).astype(
        jnp.float32)
    p["norm"] = jnp.asarray(target_params["final_norm"], jnp.float32)
  return p


def _unit_rms(x: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def fuse(head: dict, cfg: ModelConfig, feats: jax.Array) -> jax.Array:
  """Target features (..., Df) -> g (..., D): identity for EAGLE, the fused
  low/mid/high layers for EAGLE-3."""
  if "fuse" not in head:
    return feats.astype(jnp.float32)
  d = cfg.dim
  parts = [_unit_rms(feats[..., i * d:(i + 1) * d], cfg.norm_eps) for i in range(3)]
  return _dot(jnp.concatenate(parts, -1), head["fuse"])


def pair_inputs(head: dict, target_params, cfg: ModelConfig, g: jax.Array,
                tokens: jax.Array, dot=_dot) -> jax.Array:
  """u = FC([g ; emb(tokens)]): (..., D). `dot`: the matmul (`_dot`, or `shared_dot`)."""
  e = transformer.embed(target_params, tokens)
  return dot(jnp.concatenate([g.astype(jnp.float32), e], -1), head["fc"])


def layer_qkv(layer: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, dot=_dot):
  b, t = x.shape[:2]
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h = transformer.rms_norm(x, layer["attn_norm"], cfg.norm_eps)
  qkv = dot(h, layer["wqkv"])
  q = qkv[..., : hq * dh].reshape(b, t, hq, dh)
  k = qkv[..., hq * dh:(hq + hkv) * dh].reshape(b, t, hkv, dh)
  v = qkv[..., (hq + hkv) * dh:].reshape(b, t, hkv, dh)
  return (transformer.rope(q, positions, cfg.rope_theta),
          transformer.rope(k, positions, cfg.rope_theta), v)


def layer_out(layer: dict, cfg: ModelConfig, x: jax.Array, attn: jax.Array,
              dot=_dot) -> jax.Array:
  x = x + dot(attn, layer["wo"])
  h = transformer.rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
  gate, up = jnp.split(dot(h, layer["w_gate_up"]), 2, axis=-1)
  return x + dot(jax.nn.silu(gate) * up, layer["w_down"])


def head_step(head: dict, target_params, cfg: ModelConfig, g: jax.Array, tokens: jax.Array,
              positions: jax.Array, cache: cache_lib.KVCache, *,
              active: Optional[jax.Array] = None,
              allowed: Optional[jax.Array] = None,
              dot=_dot) -> Tuple[jax.Array, cache_lib.KVCache]:
  """Feed T pairs (g (B, T, D), tokens (B, T)) at the cache's fill level.
  Returns the head's outputs a (B, T, D) (its last layer's) and the cache
  (one entry per head layer) advanced by T.
  `allowed` (B, T, S): which slots each new pair attends to (default: the
  prefix below the fill level and the new pairs causally; trees pass their own).
  `dot`: the matmul of every product (`_dot`, or `shared_dot` where a program
  runs several steps of the same shape)."""
  x = pair_inputs(head, target_params, cfg, g, tokens, dot)
  length = cache.length
  t = tokens.shape[1]
  if allowed is None:
    allowed = transformer.attention_mask(length, t, cache.num_slots)
  ks, vs = [], []
  for i, layer in enumerate(head_layers(head)):
    q, k, v = layer_qkv(layer, cfg, x, positions, dot)
    ks.append(_write(cache.k[i], k, length, active))
    vs.append(_write(cache.v[i], v, length, active))
    x = layer_out(layer, cfg, x, _attention(q, ks[-1], vs[-1], allowed, cfg), dot)
  step = jnp.full(length.shape, t, jnp.int32)
  if active is not None:
    step = jnp.where(active, step, 0)
  return x, cache_lib.KVCache(k=tuple(ks), v=tuple(vs), length=length + step)


def head_weights(head: dict, target_params, cfg: ModelConfig) -> jax.Array:
  """The draft LM head: the target's (tied) head, or its rows for the reduced vocabulary.
  A loaded checkpoint carries the gathered rows as "lm_rows" (see `prepare`)."""
  if "lm_rows" in head:
    return head["lm_rows"]
  w = target_params["embed"] if cfg.tie_embeddings else target_params["lm_head"]
  if "vocab" in head:
    w = jnp.take(w, head["vocab"], axis=0)
  return w


def draft_logits(head: dict, target_params, cfg: ModelConfig, a: jax.Array,
                 w: Optional[jax.Array] = None, dot=_dot) -> jax.Array:
  """Head output (..., D) -> float32 logits over the draft vocabulary (..., Vd)."""
  if "norm" in head:
    a = transformer.rms_norm(a, head["norm"], cfg.norm_eps)
  w = head_weights(head, target_params, cfg) if w is None else w
  return dot(a, w)


def prepare(head: dict, target_params, cfg: ModelConfig) -> dict:
  """Gather the reduced vocabulary's LM-head rows once (not stored in the
  checkpoint: they are the target's). No-op for a full-vocabulary head."""
  if "vocab" not in head or "lm_rows" in head:
    return head
  return dict(head, lm_rows=head_weights(head, target_params, cfg))


def with_draft_vocab(head: dict, draft_vocab, cfg: ModelConfig) -> dict:
  """Choose the draft vocabulary at load time.

  None: as the checkpoint holds it; "full": the whole vocabulary (the head's
  output read through every LM-head row); N: the N most frequent tokens of
  the head's training answers (its "vocab_rank", most frequent first), EOS
  always included. The ranking itself is never an input of drafting.
  """
  rank = head.get("vocab_rank")
  head = {k: v for k, v in head.items() if k not in ("vocab_rank", "lm_rows")}
  choice = parse_draft_vocab(draft_vocab, cfg)
  if choice is None:
    return head
  if choice == "full":
    head.pop("vocab", None)
    return head
  return rank_vocab(head, choice, cfg, rank)


def rank_vocab(head: dict, n: int, cfg: ModelConfig, rank) -> dict:
  """The head restricted to the n first tokens of `rank` (most frequent first)."""
  out = {k: v for k, v in head.items() if k not in ("vocab_rank", "lm_rows")}
  out["vocab"] = ranked_vocab(rank, n, cfg, head.get("vocab"))
  return out


@flax.struct.dataclass
class EagleState:
  cache: cache_lib.KVCache  # the head's cache (a layer each): pairs of positions < base
  pending: jax.Array  # (B, W, Df) target features of positions base .. base + count - 1
  count: jax.Array  # (B,) int32 in [1, W]
  base: jax.Array  # (B,) int32: committed entries after the catch-up of this round


@dataclasses.dataclass(frozen=True)
class Eagle(Drafter):
  """EAGLE / EAGLE-3 chain drafter (k guesses, q from the head's distribution
  under the target's sampling settings)."""

  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  fused: bool = False  # EAGLE-3
  # > 0: dynamic draft length, stop once the chain's confidence falls below (`sample_chain`)
  draft_stop: float = 0.0
  needs_prefill_hidden = True

  @property
  def name(self) -> str:
    return "eagle3" if self.fused else "eagle"

  def __post_init__(self):
    super().__post_init__()
    check_draft_stop(self.name, self.draft_stop)
    if self.tree and self.draft_stop:
      raise ValueError(f"{self.name}: draft_stop is for chains (a tree's shape comes from "
                       "its node budget)")

  @property
  def verify_widths(self) -> tuple:
    return (self.verify_width,) if self.tree else chain_widths(self.k, self.draft_stop)

  @property
  def block(self) -> int:
    # The verify forward's k + 1; the head writes its pending pairs (<= k + 1)
    # then k - 1 drafted pairs past its committed prefix (which trails the
    # target's by one).
    return 2 * self.k + 1

  def check(self, target_cfg, params) -> None:
    if params is None or "fc" not in params or "layer" not in params:
      raise ValueError(f"{self.name}: needs a trained head (params with 'fc' and 'layer'); "
                       "load a checkpoint or train one with experiments/train.py")
    d = target_cfg.dim
    want_in = 2 * d
    if params["fc"].shape != (d, want_in):
      raise ValueError(f"{self.name}: head FC of shape {tuple(params['fc'].shape)} cannot serve "
                       f"a target of width {d} (expected {(d, want_in)})")
    if self.fused != ("fuse" in params):
      raise ValueError(f"{self.name}: the checkpoint is an "
                       f"{'EAGLE-3' if 'fuse' in params else 'EAGLE'} head")
    if "vocab" in params:
      v = params["vocab"]
      if v.ndim != 1 or int(jnp.max(v)) >= target_cfg.vocab_size or int(jnp.min(v)) < 0:
        raise ValueError(f"{self.name}: reduced vocabulary ids must lie in "
                         f"[0, {target_cfg.vocab_size})")

  def layers_for(self, cfg: ModelConfig) -> Tuple[int, ...]:
    """`hidden_layers` of the target forwards this drafter reads ((): final normed)."""
    return eagle3_layers(cfg) if self.fused else ()

  def _draw(self, head, target, logits, keys, i):
    """One guess per row from the draft logits (B, Vd) -> (x (B,), q (B, V))."""
    return draw_from(logits, self.sampling, keys, i, head.get("vocab"), target.cfg.vocab_size)

  def init(self, params, target, prompt_tokens, prompt_lengths, num_slots, hidden=None):
    """Pairs of prompt positions 0 .. P-2 into the head's cache; the feature
    of position P-1 waits in `pending` (its pair needs the first generated token)."""
    if hidden is None:
      raise ValueError(f"{self.name}: init needs the target's prefill hidden states")
    cfg = target.cfg
    b, t = prompt_tokens.shape
    w = self.k + 1
    cache = cache_lib.init_cache(head_config(cfg, len(head_layers(params))), b, num_slots,
                                 dtype=jnp.float32)
    if t > 1:
      pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
      g = fuse(params, cfg, hidden[:, :t - 1])
      _, cache = head_step(params, target.params, cfg, g, prompt_tokens[:, 1:], pos, cache)
    cache = cache.with_length(prompt_lengths - 1)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)  # (B,1,Df)
    pending = jnp.zeros((b, w, hidden.shape[-1]), jnp.float32).at[:, :1].set(last)
    return EagleState(cache=cache, pending=pending, count=jnp.ones((b,), jnp.int32),
                      base=prompt_lengths - 1)

  def catch_up(self, params, target, state, ctx):
    """Feed the pending pairs (true target features, committed tokens) ->
    (cache filled to `base`, base, the head's output at the newest committed
    position (B, D): the state that drafts the next token)."""
    cfg = target.cfg
    w = state.pending.shape[1]
    cache = state.cache
    m = cache.length
    idx = jnp.minimum(m[:, None] + 1 + jnp.arange(w)[None], ctx.history.shape[1] - 1)
    toks = jnp.take_along_axis(ctx.history, idx, axis=1)
    g = fuse(params, cfg, state.pending)
    a, cache = head_step(params, target.params, cfg, g, toks,
                         transformer.chain_positions(cache, w), cache, active=ctx.active)
    base = jnp.where(ctx.active, m + state.count, m)
    cache = cache.with_length(base)
    a_last = jnp.take_along_axis(a, (state.count - 1)[:, None, None], axis=1)[:, 0]  # (B, D)
    return cache, base, a_last

  def draft(self, params, target, state, ctx, keys):
    cfg = target.cfg
    cache, base, a_last = self.catch_up(params, target, state, ctx)
    lm_w = head_weights(params, target.params, cfg)
    first = draft_logits(params, target.params, cfg, a_last, lm_w)

    # The chain: the head's own output stands in for the next position's feature.
    def step(carry, x):
      c, a_prev = carry
      a_new, c = head_step(params, target.params, cfg, a_prev[:, None], x[:, None],
                           transformer.chain_positions(c, 1), c, active=ctx.active)
      a_new = a_new[:, 0]
      return draft_logits(params, target.params, cfg, a_new, lm_w), (c, a_new)

    def draw(logits, i):
      return self._draw(params, target, logits, keys, i)

    tokens, q, (cache, _), num = sample_chain(step, (cache, a_last), first, keys, self.k,
                                              self.sampling, ctx.active, draw=draw,
                                              draft_stop=self.draft_stop)
    num = cut_at_eos(tokens, num, cfg.eos_id)
    num = jnp.where(ctx.active, num, 0)
    return (Proposal(tokens=tokens, q=q, num_proposed=num),
            state.replace(cache=cache, base=base))

  def commit(self, params, state, ctx, verify):
    act = ctx.active
    return EagleState(
        cache=state.cache.with_length(state.base),
        pending=jnp.where(act[:, None, None], verify.hidden.astype(jnp.float32), state.pending),
        count=jnp.where(act, verify.num_accepted + 1, state.count),
        base=state.base)
