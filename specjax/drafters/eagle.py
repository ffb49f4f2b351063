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

Decoding keeps a one-layer KV cache of the committed history. Invariant
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
w_down} (one target-shaped layer), "norm": (D,) (EAGLE-3), "fuse": (D, 3D)
(EAGLE-3), "vocab": (Vd,) (optional)}.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import flax
import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.drafters.base import (Drafter, Proposal, cut_at_eos, draw_from, parse_draft_vocab,
                                   ranked_vocab, sample_chain, check_stop_below)
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

# The target's own building blocks (a head layer is a target-shaped layer).
_dot = transformer._dot  # pylint: disable=protected-access
_write = transformer._write  # pylint: disable=protected-access
_attention = transformer._attention  # pylint: disable=protected-access


def eagle3_layers(cfg: ModelConfig) -> Tuple[int, int, int]:
  """Low / middle / high target layers EAGLE-3 fuses (outputs of these layers)."""
  n = cfg.num_layers
  return (min(2, n - 1), n // 2, max(n - 3, 0))


def head_config(cfg: ModelConfig) -> ModelConfig:
  """The one-layer head's config: the target's layer shape."""
  return cfg.replace(num_layers=1)


def init_head(key: jax.Array, cfg: ModelConfig, *, fused: bool,
              vocab: Optional[jax.Array] = None) -> dict:
  """Random head (float32): a fresh target-shaped layer, FC near [I, 0]."""
  d = cfg.dim
  k_layer, k_fc, k_fuse = jax.random.split(key, 3)
  layer = transformer.init(k_layer, head_config(cfg).replace(dtype="float32"))["layers"][0]
  # The layer's output projections start small: the head starts close to
  # "the next feature is this one" and learns the residual.
  layer["wo"] = layer["wo"] * 0.1
  layer["w_down"] = layer["w_down"] * 0.1
  fc = jnp.concatenate([jnp.eye(d), jax.random.normal(k_fc, (d, d)) * 0.02 / jnp.sqrt(d)], 1)
  p = {"fc": fc.astype(jnp.float32), "layer": layer}
  if fused:
    eye3 = jnp.concatenate([jnp.eye(d) / 3] * 3, axis=1)
    p["fuse"] = (eye3 + jax.random.normal(k_fuse, (d, 3 * d)) * 0.01 / jnp.sqrt(d)).astype(
        jnp.float32)
    p["norm"] = jnp.ones((d,), jnp.float32)
  if vocab is not None:
    p["vocab"] = jnp.asarray(vocab, jnp.int32)
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
                tokens: jax.Array) -> jax.Array:
  """u = FC([g ; emb(tokens)]): (..., D)."""
  e = transformer.embed(target_params, tokens)
  return _dot(jnp.concatenate([g.astype(jnp.float32), e], -1), head["fc"])


def layer_qkv(layer: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array):
  b, t = x.shape[:2]
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h = transformer.rms_norm(x, layer["attn_norm"], cfg.norm_eps)
  qkv = _dot(h, layer["wqkv"])
  q = qkv[..., : hq * dh].reshape(b, t, hq, dh)
  k = qkv[..., hq * dh:(hq + hkv) * dh].reshape(b, t, hkv, dh)
  v = qkv[..., (hq + hkv) * dh:].reshape(b, t, hkv, dh)
  return (transformer.rope(q, positions, cfg.rope_theta),
          transformer.rope(k, positions, cfg.rope_theta), v)


def layer_out(layer: dict, cfg: ModelConfig, x: jax.Array, attn: jax.Array) -> jax.Array:
  x = x + _dot(attn, layer["wo"])
  h = transformer.rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
  gate, up = jnp.split(_dot(h, layer["w_gate_up"]), 2, axis=-1)
  return x + _dot(jax.nn.silu(gate) * up, layer["w_down"])


def head_step(head: dict, target_params, cfg: ModelConfig, g: jax.Array, tokens: jax.Array,
              positions: jax.Array, cache: cache_lib.KVCache, *,
              active: Optional[jax.Array] = None,
              allowed: Optional[jax.Array] = None) -> Tuple[jax.Array, cache_lib.KVCache]:
  """Feed T pairs (g (B, T, D), tokens (B, T)) at the cache's fill level.
  Returns the head's outputs a (B, T, D) and the cache advanced by T.
  `allowed` (B, T, S): which slots each new pair attends to (default: the
  prefix below the fill level and the new pairs causally; trees pass their own)."""
  x = pair_inputs(head, target_params, cfg, g, tokens)
  q, k, v = layer_qkv(head["layer"], cfg, x, positions)
  length = cache.length
  t = tokens.shape[1]
  new_k = _write(cache.k[0], k, length, active)
  new_v = _write(cache.v[0], v, length, active)
  if allowed is None:
    allowed = transformer.attention_mask(length, t, cache.num_slots)
  attn = _attention(q, new_k, new_v, allowed, cfg)
  a = layer_out(head["layer"], cfg, x, attn)
  step = jnp.full(length.shape, t, jnp.int32)
  if active is not None:
    step = jnp.where(active, step, 0)
  return a, cache_lib.KVCache(k=(new_k,), v=(new_v,), length=length + step)


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
                 w: Optional[jax.Array] = None) -> jax.Array:
  """Head output (..., D) -> float32 logits over the draft vocabulary (..., Vd)."""
  if "norm" in head:
    a = transformer.rms_norm(a, head["norm"], cfg.norm_eps)
  w = head_weights(head, target_params, cfg) if w is None else w
  return _dot(a, w)


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
  cache: cache_lib.KVCache  # the head's one-layer cache: pairs of positions < base
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
  stop_below: float = 0.0
  needs_prefill_hidden = True

  @property
  def name(self) -> str:
    return "eagle3" if self.fused else "eagle"

  def __post_init__(self):
    super().__post_init__()
    check_stop_below(self.name, self.stop_below)
    if self.tree and self.stop_below:
      raise ValueError(f"{self.name}: stop_below is for chains (a tree's shape comes from "
                       "its node budget)")

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
    cache = cache_lib.init_cache(head_config(cfg), b, num_slots, dtype=jnp.float32)
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

  def propose(self, params, target, state, ctx, target_cache, keys):
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
                                              stop_below=self.stop_below)
    num = cut_at_eos(tokens, num, cfg.eos_id)
    num = jnp.where(ctx.active, num, 0)
    return (Proposal(tokens=tokens, q=q, num_proposed=num),
            state.replace(cache=cache, base=base), target_cache)

  def commit(self, params, state, ctx, verify):
    act = ctx.active
    return EagleState(
        cache=state.cache.with_length(state.base),
        pending=jnp.where(act[:, None, None], verify.hidden.astype(jnp.float32), state.pending),
        count=jnp.where(act, verify.num_accepted + 1, state.count),
        base=state.base)



# ---- dynamic trees (EAGLE-2) ------------------------------------------------------

# Exact: "wor", "topk". LOSSY (opt-in, for measuring it): "topk_q" (see MedusaTree).
EAGLE_TREE_MODES = ("wor", "topk", "topk_q")


@dataclasses.dataclass(frozen=True)
class EagleTree(Eagle):
  """EAGLE / EAGLE-3 head drafting a dynamic tree (EAGLE-2, Li et al. 2024,
  arXiv:2406.16858) of depth k.

  Depth 1: `topk` children of the root from the head's output at the newest
  committed position. Each further depth expands the `width` nodes of the
  previous depth with the highest cumulative confidence (the sum of the
  head's log-probabilities along the path, at T = 1): their pairs (the
  parent's head output, the node's token) go through the head in one step
  with tree attention (committed entries + the node's expanded ancestors),
  and each gets `topk` children. All candidates: topk + (k - 1) width topk.

  * Greedy targets, and mode "topk" under sampling: children are the head's
    top tokens (deterministic candidates, one-hot q); the candidates are
    reranked by cumulative confidence to the `nodes` best (EAGLE-2's rerank;
    a parent always ranks above its children).
  * Mode "wor" (default under sampling, exact): children are a Gumbel-top-k
    draw (without replacement) from the head's q under the target's sampling
    settings, node q the without-replacement q. Every drawn child is kept --
    a rerank would select children by their own values, which breaks
    exactness -- so the tree has all topk + (k - 1) width topk candidates and
    `nodes` is ignored. Choosing which nodes to expand by their confidence is
    allowed: it decides a node's children before they are drawn.
  * Mode "topk_q" (LOSSY, opt-in): mode "topk"'s candidates tested with the
    head's q as if sampled from it (the mistake of the fixed-top-k dispute;
    "topk", EAGLE-2's "q = 1", is the exact form).
  """

  topk: int = 4
  width: int = 4
  nodes: int = 16
  mode: str = "wor"
  tree = True

  @property
  def name(self) -> str:
    return "eagle3_tree" if self.fused else "eagle_tree"

  def __post_init__(self):
    super().__post_init__()
    if self.mode not in EAGLE_TREE_MODES:
      raise ValueError(f"{self.name}: mode must be one of {EAGLE_TREE_MODES}, got {self.mode!r}")
    if self.topk < 1 or self.width < 1:
      raise ValueError(f"{self.name}: need topk >= 1 and width >= 1")
    if self.width > self.topk:
      raise ValueError(f"{self.name}: width ({self.width}) cannot exceed topk ({self.topk}): "
                       "depth 1 has only topk nodes to expand")
    if not 1 <= self.num_nodes <= self.candidates:
      raise ValueError(f"{self.name}: nodes must lie in [1, {self.candidates}] (the candidates "
                       f"of topk={self.topk}, width={self.width}, depth {self.k})")

  @property
  def candidates(self) -> int:
    return self.topk + (self.k - 1) * self.width * self.topk

  @property
  def deterministic_tree(self) -> bool:
    return self.sampling.greedy or self.mode in ("topk", "topk_q")

  @property
  def lossy(self) -> bool:
    return self.mode == "topk_q"

  @property
  def num_nodes(self) -> int:
    """The verified tree's nodes: `nodes` for deterministic candidates (reranked
    to that budget); a sampled tree keeps all its candidates."""
    return self.nodes if self.deterministic_tree else self.candidates

  @property
  def block(self) -> int:
    # verify: nodes + 1; the head: its pending pairs (k + 1) + the fed frontier
    return max(self.num_nodes + 1, self.k + 1 + (self.k - 1) * self.width + 1)

  def _children(self, logits, q_sub, key, vocab, vocab_size):
    """Children of P parents of one row: logits (P, Vd) -> tokens (P, K) ids,
    q (P, K, V) (None for deterministic candidates), log-confidence (P, K)."""
    kk = self.topk
    logconf = jax.nn.log_softmax(logits, -1)
    if self.deterministic_tree:
      conf, j = jax.lax.top_k(logconf, kk)
      q = None
      if self.mode == "topk_q" and not self.sampling.greedy:  # LOSSY: the parent's q
        q = jnp.broadcast_to(q_sub[:, None], (q_sub.shape[0], kk, q_sub.shape[-1]))
        if vocab is not None:
          q = jnp.zeros(q.shape[:-1] + (vocab_size,), jnp.float32).at[..., vocab].set(q)
    else:
      g = jax.random.gumbel(key, logits.shape, jnp.float32)  # one row: (P, Vd)
      score = jnp.where(q_sub > 0, jnp.log(jnp.maximum(q_sub, 1e-38)) + g, -jnp.inf)
      _, j = jax.lax.top_k(score, kk)
      conf = jnp.take_along_axis(logconf, j, -1)
      from specjax import verify as verify_lib  # pylint: disable=import-outside-toplevel
      q = verify_lib.without_replacement(q_sub, j)  # (B, P, K, Vd)
      if vocab is not None:
        q = jnp.zeros(q.shape[:-1] + (vocab_size,), jnp.float32).at[..., vocab].set(q)
    ids = j.astype(jnp.int32) if vocab is None else vocab[j]
    return ids, q, conf

  def propose(self, params, target, state, ctx, target_cache, keys):
    cfg = target.cfg
    vsize = cfg.vocab_size
    vocab = params.get("vocab")
    b = ctx.length.shape[0]
    kk, w, depth = self.topk, self.width, self.k
    cache, base, a_last = self.catch_up(params, target, state, ctx)
    lm_w = head_weights(params, target.params, cfg)
    dkeys = jax.vmap(lambda key: jax.random.split(key, depth))(keys)  # (B, depth)

    def draw(a, d):  # head outputs (B, P, D) -> children of those P parents
      logits = draft_logits(params, target.params, cfg, a, lm_w)
      q_sub = sampling_lib.probs(logits, self.sampling)
      return jax.vmap(lambda lg, qs, k_: self._children(lg, qs, k_, vocab, vsize))(
          logits, q_sub, dkeys[:, d])

    tok, q, conf = draw(a_last[:, None], 0)  # (B, 1, K)
    tokens = [tok.reshape(b, kk)]
    qs = [None if q is None else q.reshape(b, kk, vsize)]
    scores = [conf.reshape(b, kk)]
    parents = [jnp.full((b, kk), -1, jnp.int32)]
    a_of = [jnp.broadcast_to(a_last[:, None], (b, kk, a_last.shape[-1]))]  # parent's output
    start = [0]  # node index of each depth's first node
    n_fed = (depth - 1) * w
    anc = jnp.zeros((b, max(n_fed, 1), max(n_fed, 1)), bool)  # among fed entries
    entry_prev = None  # (B, W): fed entry of each frontier node of the last depth
    slots = cache.num_slots
    for d in range(1, depth):
      # the frontier: the w most confident nodes of depth d
      _, sel = jax.lax.top_k(scores[-1], w)  # (B, W) indices within depth d's block
      f_tok = jnp.take_along_axis(tokens[-1], sel, 1)
      f_a = jnp.take_along_axis(a_of[-1], sel[..., None], 1)
      f_score = jnp.take_along_axis(scores[-1], sel, 1)
      e0 = (d - 1) * w
      eid = e0 + jnp.arange(w)
      if d == 1:
        rows = jax.nn.one_hot(eid, n_fed, dtype=bool)[None].repeat(b, 0)  # (B, W, E)
      else:
        par_local = jnp.take_along_axis(parents[-1], sel, 1) - start[-2]  # index in depth d-1
        # the parent was fed iff it was in the previous frontier
        par_entry = jnp.take_along_axis(entry_prev, jnp.clip(par_local, 0, entry_prev.shape[1] - 1),
                                        1)
        rows = (jnp.take_along_axis(anc, par_entry[..., None], 1)
                | jax.nn.one_hot(eid, n_fed, dtype=bool)[None])
      anc = anc.at[:, e0:e0 + w].set(rows)
      # entries of the frontier of depth d, by node index within its block
      nd = tokens[-1].shape[1]
      entry_now = jnp.full((b, nd), -1, jnp.int32).at[jnp.arange(b)[:, None], sel].set(eid)
      rel = jnp.arange(slots)[None, None, :] - base[:, None, None]
      vis = jnp.take_along_axis(rows, jnp.clip(rel, 0, n_fed - 1).repeat(w, 1), 2)
      allowed = (rel < 0) | ((rel >= 0) & (rel < e0 + w) & vis)
      pos = jnp.broadcast_to((base + d - 1)[:, None], (b, w))
      c = cache.with_length(base + e0)
      a_new, fed = head_step(params, target.params, cfg, f_a, f_tok, pos, c, active=ctx.active,
                             allowed=allowed)
      cache = cache.replace(k=fed.k, v=fed.v)  # the fill level stays at base
      tok, q, conf = draw(a_new, d)  # (B, W, K)
      sel_nodes = start[-1] + sel  # global node index of each frontier node
      tokens.append(tok.reshape(b, w * kk))
      qs.append(None if q is None else q.reshape(b, w * kk, vsize))
      scores.append((f_score[..., None] + conf).reshape(b, w * kk))
      parents.append(jnp.repeat(sel_nodes, kk, axis=1).astype(jnp.int32))
      a_of.append(jnp.repeat(a_new, kk, axis=1))
      start.append(start[-1] + nd)
      entry_prev = entry_now
    tokens = jnp.concatenate(tokens, 1)
    parent = jnp.concatenate(parents, 1)
    score = jnp.concatenate(scores, 1)
    total = tokens.shape[1]
    if qs[0] is None:  # deterministic candidates: one-hot q
      q = jax.nn.one_hot(tokens, vsize, dtype=jnp.float32)
    else:
      q = jnp.concatenate(qs, 1)
    if self.num_nodes < total:  # rerank (deterministic trees only): the most confident nodes
      dep = jnp.concatenate([jnp.full((x.shape[1],), i + 1) for i, x in enumerate(scores)])
      key_ = score - 1e-4 * dep[None]  # ties: parents first
      _, keep = jax.lax.top_k(key_, self.num_nodes)
      keep = jnp.sort(keep, axis=1)  # node order (topological, siblings in rank order)
      new_index = jnp.cumsum(jnp.zeros((b, total), jnp.int32).at[
          jnp.arange(b)[:, None], keep].set(1), axis=1) - 1
      par = jnp.take_along_axis(parent, keep, 1)
      parent = jnp.where(par < 0, -1, jnp.take_along_axis(new_index, jnp.maximum(par, 0), 1))
      tokens = jnp.take_along_axis(tokens, keep, 1)
      q = jnp.take_along_axis(q, keep[..., None], 1)
    num = jnp.where(ctx.active, self.num_nodes, 0).astype(jnp.int32)
    return (Proposal(tokens=tokens, q=q, num_proposed=num, parent=parent),
            state.replace(cache=cache.with_length(base), base=base), target_cache)
