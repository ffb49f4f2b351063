"""Training EAGLE and EAGLE-3 heads on the frozen target's own answers.

Features: one target forward per batch of sequences, kept in host memory per
sequence (the final normed hidden state f, and for EAGLE-3 also the low /
middle / high layer outputs), reused by every epoch.

Training batches are whole sequences from position 0 (prompt + answer,
length-bucketed, `SeqPool.sequence_batch`), so the head attends to the same
prefix it has in its cache while drafting; the loss is on answer positions,
and the draft LM head runs on those only (gathered per batch, `loss_rows`, in
a size fixed per length bucket), not on the prompt's and padding's slots.
(`SeqPool.batch`'s random T-position windows near the answer are the older
recipe, kept for comparison: there the head sees at most T - 1 positions of
history and rarely the instruction.) In either, a window holds T consecutive
positions j of one sequence. The head reads
the pairs (g_j, x_{j+1}) and its output a_j is trained to give the target's
distribution p_{j+1} = softmax(LMHead(f_{j+1})) (the distribution of
x_{j+2}; soft labels, cross-entropy over the draft vocabulary) -- and, for
EAGLE, to regress f_{j+1} (smooth L1), with uniform noise on the input
features (the paper's augmentation against its own feature errors).

Unrolled steps (EAGLE-3's training-time test, and the acceptance estimate of
both): step s >= 1 feeds the head's own previous output a^{s-1}_{j-1} in
place of the target feature, as drafting does. A query of step s at position
j models a chain that started at c = j - s: it attends to step-0 entries
(true features) of positions <= c and to its own chain, the step-r entry of
position c + r for r = 1..s -- exactly the head's cache while drafting the
(s+1)-th guess.

Cheap acceptance estimate (validation windows): unroll k steps; per chain
start c and step s, greedy agreement (argmax q == argmax p) and
sum_x min(p, q) at T = 1; tau_greedy = 1 + mean_c sum_m prod_{s<m} correct,
tau_t1 = 1 + mean_c sum_m prod_{s<m} overlap, the implied expected tokens
per round of a k-chain. tau_rounds walks each sequence as greedy decoding
does (a round starts where the last one's tokens end:
`theory.greedy_rounds`), tokens / rounds: what a greedy benchmark measures on
that text, below tau where acceptance varies along it.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.analysis import theory
from specjax.drafters import eagle
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig
from specjax.training import features as features_lib


# Length buckets of whole-sequence batches (a compiled step shape each).
BUCKETS = (64, 128, 256, 512, 1024)
# Batch entries a data-parallel step replicates rather than splits over its
# devices: the step's key, and the gathered loss positions, which index the
# whole global batch (`SeqPool.sequence_batch`).
REPLICATED = ("key", "loss_rows", "loss_rows_on")


class SeqPool:
  """Per-sequence target features: tokens, final normed hidden f, taps."""

  def __init__(self, tokens, final, taps, plen, top_ids=None, top_p=None):
    self.tokens, self.final, self.taps, self.plen = tokens, final, taps, plen
    self.top_ids, self.top_p = top_ids, top_p  # the teacher's top-K per position, or None
    self._by_width = None  # (buckets, widths, shares), by _buckets
    self._gather: Dict[Tuple[int, int], Optional[int]] = {}  # (width, rows) -> _loss_rows
    # per sequence, the first label index trained on when the loss covers more
    # than the answer (`train_on_sequence`); None: the answer only
    self.loss_start: Optional[List[int]] = None
    # what a length bucket's share counts: 'answer' or 'loss' positions
    self.bucket_weight = "answer"

  @classmethod
  def concat(cls, pools: Sequence["SeqPool"]) -> "SeqPool":
    """One pool of the pools' sequences, in order (e.g. features computed at
    two lengths); they must all hold the teacher's top-K, or none."""
    if len({p.top_ids is None for p in pools}) > 1:
      raise ValueError("pools to join must all hold the teacher's top-K, or none")
    cat = lambda name: [x for p in pools for x in getattr(p, name)]  # pylint: disable=unnecessary-lambda-assignment
    top = pools[0].top_ids is not None
    return cls(cat("tokens"), cat("final"), cat("taps"), cat("plen"),
               top_ids=cat("top_ids") if top else None, top_p=cat("top_p") if top else None)

  def __len__(self):
    return len(self.tokens)

  @property
  def num_positions(self) -> int:
    return int(sum(max(len(t) - max(p - 1, 0) - 1, 0) for t, p in zip(self.tokens, self.plen)))

  @classmethod
  def build(cls, params, cfg, sequences: Sequence[Tuple[List[int], int]], *, seq_len: int,
            taps: Tuple[int, ...] = (), top_k: int = 0, batch_size: int = 4, progress=None,
            cache_dir: Optional[str] = None,
            reuse_taps: Sequence[Tuple[int, ...]] = ()) -> "SeqPool":
    """The target's features of `sequences` (`specjax.training.features`:
    with `cache_dir`, shards computed before for the same target and data are
    read from there, memory-mapped); `top_k` > 0 adds the teacher's top-K
    distribution at every position."""
    f = features_lib.build(params, cfg, sequences, seq_len=seq_len, taps=taps, top_k=top_k,
                           batch_size=batch_size, cache_dir=cache_dir, progress=progress,
                           reuse_taps=reuse_taps)
    return cls(f["tokens"], f["final"], f["taps"], f["plen"],
               top_ids=f["top_ids"] if top_k else None, top_p=f["top_p"] if top_k else None)

  def covered_mass(self) -> float:
    """Mean probability mass of the stored top-K teacher distributions over
    the answer positions' labels (1.0 without them: the full distribution)."""
    if self.top_p is None:
      return 1.0
    total, n = 0.0, 0
    for i in range(len(self)):
      lo = max(self.plen[i] - 1, 1)  # p_j for labels x_{j+1}, j + 1 >= plen
      mass = np.asarray(self.top_p[i][lo:], np.float64).sum(-1)
      total, n = total + mass.sum(), n + len(mass)
    return total / max(n, 1)

  def train_on_sequence(self) -> int:
    """Put the loss on every position whose label follows the chat template's
    shared head (the system turn and the user header, the same tokens in every
    sequence), prompt positions included, instead of on the answer only.

    The labels are the target's own distributions at every position, so a
    prompt position is as true a sample of the feature -> next-token map as an
    answer position, and a whole-sequence batch runs the head over the prompt
    anyway: the extra supervision costs no compute. The tau estimate and the
    epoch count stay on answer positions. Returns the shared head's length."""
    shared = os.path.commonprefix([list(t) for t in self.tokens]) if len(self) > 1 else []
    self.loss_start = [len(shared)] * len(self)
    self._gather = {}
    return len(shared)

  @property
  def num_loss_positions(self) -> int:
    """Positions the loss covers (the answer's, or more: `train_on_sequence`)."""
    if self.loss_start is None:
      return self.num_positions
    return int(sum(max(len(t) - max(s - 1, 0) - 1, 0) for t, s in zip(self.tokens,
                                                                   self.loss_start)))

  def window(self, i: int, start: int, t: int) -> dict:
    """Window of positions start .. start + t - 1 of sequence i (padded)."""
    tok, f, tp, plen = self.tokens[i], self.final[i], self.taps[i], self.plen[i]
    n, d = len(tok), f.shape[1]
    j = start + np.arange(t)
    ok_in = j + 1 < n  # the pair (g_j, x_{j+1}) exists and f_{j+1} is known
    jc = np.minimum(j, n - 1)
    j1 = np.minimum(j + 1, n - 1)
    g = np.asarray((tp if tp is not None else f)[jc], np.float32)
    return {
        "g": np.where(ok_in[:, None], g, 0).astype(np.float32),
        "tokens": np.where(ok_in, tok[j1], 0).astype(np.int32),  # x_{j+1}
        "f_next": np.where(ok_in[:, None], np.asarray(f[j1], np.float32), 0),  # f_{j+1}
        "positions": j.astype(np.int32),
        "in_seq": ok_in.astype(np.float32),
        **({} if self.top_ids is None else {  # p_{j+1}'s top-K (the label's distribution)
            "p_ids": np.where(ok_in[:, None], self.top_ids[i][j1], 0).astype(np.int32),
            "p_top": np.where(ok_in[:, None], self.top_p[i][j1], 0).astype(np.float32)}),
        # the label x_{j+2} ~ p_{j+1} is an answer token
        "answer": (ok_in & (j + 2 >= plen)).astype(np.float32),
        # the positions the loss covers (the answer's unless `train_on_sequence`)
        **({} if self.loss_start is None else {
            "loss": (ok_in & (j + 2 >= self.loss_start[i])).astype(np.float32)}),
        "d": d,
    }

  def batch(self, rng: np.random.Generator, batch_size: int, t: int) -> dict:
    """Random windows overlapping each sequence's answer."""
    rows = []
    for _ in range(batch_size):
      i = int(rng.integers(len(self)))
      n, plen = len(self.tokens[i]), self.plen[i]
      lo = max(plen - 2 - t // 4, 0)
      hi = max(n - t // 2, lo + 1)
      rows.append(self.window(i, int(rng.integers(lo, hi)), t))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0] if k != "d"}

  def width(self, i: int) -> int:
    """Sequence i's bucket: the smallest of `BUCKETS` holding it (else its
    length rounded up to 64)."""
    n = len(self.tokens[i])
    return next((w for w in BUCKETS if w >= n), cache_lib.round_up(n, 64))

  def sequence_batch(self, rng: np.random.Generator, batch_tokens: int) -> dict:
    """Whole sequences from position 0 (prompt + answer, loss on the answer),
    as drafting sees them: the head attends to the whole prefix. One length
    bucket per batch, `batch_tokens // width` sequences of it (at least one);
    the bucket is drawn in proportion to its answer positions, so every
    position is equally likely to be trained on."""
    by_width, widths, share = self._buckets()
    w = widths[int(rng.choice(len(widths), p=share))]
    members = by_width[w]
    rows = max(batch_tokens // w, 1)
    pick = rng.choice(len(members), size=rows, replace=len(members) < rows)
    chosen = [self.window(members[int(j)], 0, w) for j in pick]
    out = {k: np.stack([r[k] for r in chosen]) for k in chosen[0] if k != "d"}
    m = self._loss_rows(w, rows)
    if m is not None:  # the loss's positions, gathered: `loss_fn` runs the LM head on them only
      idx = np.flatnonzero(out.get("loss", out["answer"]).reshape(-1))
      out["loss_rows"] = np.pad(idx, (0, m - len(idx))).astype(np.int32)
      out["loss_rows_on"] = (np.arange(m) < len(idx)).astype(np.float32)
    return out

  def _loss_rows(self, w: int, rows: int) -> Optional[int]:
    """The gathered loss positions of a batch of `rows` sequences of bucket
    `w`: a bound fixed per bucket (one compiled shape each, as before), rows
    times the bucket's most loss positions in one sequence, rounded up to 64;
    None where that is no smaller than the batch (nothing to save)."""
    key = (w, rows)
    if key not in self._gather:
      start = self.plen if self.loss_start is None else self.loss_start
      most = max(self._window_loss_positions(i, start[i], w) for i in self._buckets()[0][w])
      m = cache_lib.round_up(rows * most, 64)
      self._gather[key] = m if m < rows * w else None
    return self._gather[key]

  def _window_loss_positions(self, i: int, start: int, t: int) -> int:
    """How many positions of `window(i, 0, t)` the loss covers (j < t with
    j + 1 < n and j + 2 >= start)."""
    hi = min(t - 1, len(self.tokens[i]) - 2)
    return max(hi - max(start - 2, 0) + 1, 0)

  def eval_sequences(self, max_sequences: Optional[int] = None) -> List[dict]:
    """Every sequence whole from position 0 (its bucket's width), in order."""
    n = len(self) if not max_sequences else min(len(self), max_sequences)
    return [self.window(i, 0, self.width(i)) for i in range(n) if self._answer_positions(i)]

  def _answer_positions(self, i: int) -> int:
    return max(len(self.tokens[i]) - max(self.plen[i] - 1, 0) - 1, 0)

  def _loss_positions(self, i: int) -> int:
    start = self.plen[i] if self.loss_start is None else self.loss_start[i]
    return max(len(self.tokens[i]) - max(start - 1, 0) - 1, 0)

  def _buckets(self) -> Tuple[Dict[int, List[int]], List[int], np.ndarray]:
    """(width -> its sequences, the widths, each width's share of the answer
    positions), computed once."""
    if self._by_width is None:
      by_width: Dict[int, List[int]] = {}
      for i in range(len(self)):
        if self._answer_positions(i):
          by_width.setdefault(self.width(i), []).append(i)
      widths = sorted(by_width)
      if self.bucket_weight not in ("answer", "loss"):
        raise ValueError(f"unknown bucket_weight {self.bucket_weight!r} (known: answer, loss)")
      count = self._answer_positions if self.bucket_weight == "answer" else self._loss_positions
      weight = np.asarray([sum(count(i) for i in by_width[w]) for w in widths], np.float64)
      self._by_width = (by_width, widths, weight / weight.sum())
    return self._by_width

  def eval_windows(self, t: int, max_windows: Optional[int] = None) -> List[dict]:
    """Deterministic windows tiling every sequence's answer."""
    out = []
    for i in range(len(self)):
      n, plen = len(self.tokens[i]), self.plen[i]
      for start in range(max(plen - 2, 0), n - 1, t):
        out.append(self.window(i, start, t))
        if max_windows and len(out) >= max_windows:
          return out
    return out


def token_counts(sequences: Sequence[Tuple[List[int], int]], vocab_size: int) -> np.ndarray:
  """How often each token appears in the answers (for the reduced draft vocabulary)."""
  counts = np.zeros(vocab_size, np.int64)
  for ids, plen in sequences:
    np.add.at(counts, np.asarray(ids[plen:], np.int64), 1)
  return counts


def reduced_vocab(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray:
  """The `size` most frequent tokens (ties by id), always including `always`
  (e.g. EOS), sorted by id."""
  order = token_rank(counts)
  keep = [int(a) for a in always if 0 <= a < len(counts)]
  keep += [int(x) for x in order if int(x) not in keep][:max(size - len(keep), 0)]
  return np.sort(np.asarray(keep, np.int32))


def _chain_attention(q, ks, vs, s: int, cfg: ModelConfig):
  """Attention of step-s queries q (B, T, H, Dh): step-0 keys at positions
  <= j - s, and the step-r key at position j - s + r for r = 1..s."""
  b, t = q.shape[:2]
  g, r, dh = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
  qg = q.reshape(b, t, g, r, dh)
  scale = dh ** -0.5
  s0 = jnp.einsum("btgrd,bsgd->btgrs", qg, ks[0]) * scale  # (B, T, G, R, T)
  jj = jnp.arange(t)
  allowed0 = jj[None, :] <= (jj[:, None] - s)  # (T, T)
  s0 = jnp.where(allowed0[None, :, None, None, :], s0, -jnp.inf)
  diag, vals = [], []
  for rr in range(1, s + 1):
    shift = s - rr  # key of step rr at position j - shift
    k_r = jnp.pad(ks[rr], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t]
    v_r = jnp.pad(vs[rr], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t]
    diag.append(jnp.einsum("btgrd,btgd->btgr", qg, k_r) * scale)
    vals.append(v_r)
  if diag:
    scores = jnp.concatenate([s0, jnp.stack(diag, -1)], -1)
  else:
    scores = s0
  # Rows with no visible key (j < s) are masked out of the loss; keep them finite.
  scores = jnp.where(jnp.isneginf(jnp.max(scores, -1, keepdims=True)), 0.0, scores)
  w = jax.nn.softmax(scores, -1)
  out = jnp.einsum("btgrs,bsgd->btgrd", w[..., :t], vs[0])
  for i, v_r in enumerate(vals):
    out = out + w[..., t + i, None] * v_r[:, :, :, None, :]
  return out.reshape(b, t, cfg.num_heads * dh)


def unroll(head, target_params, cfg: ModelConfig, batch: dict, steps: int,
           noise: Optional[jax.Array] = None,
           keep: Optional[jax.Array] = None) -> List[jax.Array]:
  """Outputs a^s (B, T, D) of steps s = 0 .. steps-1 (see the module docstring).
  Training only: `keep` (B, T, D) scales the (fused) target features (dropout),
  `noise` is added to them."""
  layers = eagle.head_layers(head)
  g = eagle.fuse(head, cfg, batch["g"])
  if keep is not None:
    g = g * keep
  if noise is not None:
    g = g + noise
  # keys / values of every step, per head layer: step s's queries of layer l
  # attend to layer l's entries of steps 0..s, as its cache holds them when drafting
  ks, vs = [[] for _ in layers], [[] for _ in layers]
  outs = []
  for s in range(steps):
    if s > 0:  # the head's own output of the previous position stands in for g
      g = jnp.pad(outs[-1], ((0, 0), (1, 0), (0, 0)))[:, :-1]
    x = eagle.pair_inputs(head, target_params, cfg, g, batch["tokens"])
    for i, layer in enumerate(layers):
      q, k, v = eagle.layer_qkv(layer, cfg, x, batch["positions"])
      ks[i].append(k)
      vs[i].append(v)
      x = eagle.layer_out(layer, cfg, x, _chain_attention(q, ks[i], vs[i], s, cfg))
    outs.append(x)
  return outs


def target_probs(target_params, cfg, f_next, vocab=None):
  """The target's distributions from its final normed features -> (p over
  the draft vocabulary, p over all tokens)."""
  logits = transformer.lm_head(target_params, cfg, f_next)
  p = jax.nn.softmax(logits, -1)
  return p if vocab is None else jnp.take(p, vocab, axis=-1), p


def token_rank(counts: np.ndarray) -> np.ndarray:
  """Every token id, most frequent first (ties by id): a checkpoint's "vocab_rank"."""
  return np.lexsort((np.arange(len(counts)), -counts))


def vocab_index(vocab, vocab_size: int) -> jax.Array:
  """(vocab_size,) int32: each token's index in the draft vocabulary, -1 outside it."""
  return jnp.full((vocab_size,), -1, jnp.int32).at[vocab].set(
      jnp.arange(vocab.shape[0], dtype=jnp.int32))


def teacher_from_top_k(ids, probs, vocab, vocab_size: int) -> jax.Array:
  """Dense teacher distributions (..., Vd) over the draft vocabulary (all
  tokens when `vocab` is None) from top-K ids / probabilities (..., K); the
  mass outside the top K, or outside the draft vocabulary, is dropped, as
  `target_probs`' reduced distributions drop the latter."""
  if vocab is None:
    col, size = ids, vocab_size
  else:
    col, size = vocab_index(vocab, vocab_size)[ids], vocab.shape[0]
  lead = ids.shape[:-1]
  dense = jnp.zeros((int(np.prod(lead)), size), jnp.float32)
  rows = jnp.arange(dense.shape[0])[:, None]
  flat_col = col.reshape(-1, ids.shape[-1])
  flat_p = jnp.where(flat_col >= 0, probs.reshape(flat_col.shape), 0.0)
  dense = dense.at[rows, jnp.maximum(flat_col, 0)].add(flat_p)
  return dense.reshape(lead + (size,))


def loss_fn(head, target_params, cfg, batch, vocab, noise, *, steps: int, w_reg: float,
            w_cls: float, decay: float, keep=None):
  lm_w = eagle.head_weights(dict(head, **({} if vocab is None else {"vocab": vocab})),
                            target_params, cfg)
  outs = unroll(head, target_params, cfg, batch, steps, noise, keep)
  if "loss_rows" in batch:  # (M,) flat indices of the loss positions (`sequence_batch`)
    def take(x):  # (B, T, ...) -> (M, ...): the LM head and the loss run on these only
      return x.reshape((-1,) + x.shape[2:])[batch["loss_rows"]]
    live = batch["loss_rows_on"]
  else:
    take, live = (lambda x: x), 1.0
  if "p_ids" in batch:  # the stored top-K teacher distributions: no LM head here
    p_ids = take(batch["p_ids"])
    p_sub = teacher_from_top_k(p_ids, take(batch["p_top"]), vocab, cfg.vocab_size)
    target_tok = p_ids[..., 0]
  else:
    p_sub, p = target_probs(target_params, cfg, take(batch["f_next"]), vocab)
    target_tok = jnp.argmax(jax.lax.stop_gradient(p), -1)
  p_sub = jax.lax.stop_gradient(p_sub)
  total, metrics = 0.0, {}
  tpos = jnp.arange(batch["tokens"].shape[1])
  on = batch.get("loss", batch["answer"])  # the positions trained on
  for s, a in enumerate(outs):
    mask = take(on * (tpos >= s)[None]) * live
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    a = take(a)
    logits = eagle.draft_logits(head, target_params, cfg, a, lm_w)
    logq = jax.nn.log_softmax(logits, -1)
    ce = -jnp.sum(p_sub * logq, -1)
    loss_s = w_cls * jnp.sum(ce * mask) / denom
    if w_reg and s == 0:
      diff = jnp.abs(a - take(batch["f_next"]))
      sl1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
      reg = jnp.sum(sl1 * mask) / denom
      loss_s = loss_s + w_reg * reg
      metrics["reg"] = reg
    top = jnp.argmax(logits, -1)
    top = top if vocab is None else vocab[top]
    metrics[f"acc{s}"] = jnp.sum((top == target_tok) * mask) / denom
    total = total + (decay ** s) * loss_s
  metrics["loss"] = total
  return total, metrics


def make_step(optimizer, target_params, cfg, *, vocab=None, steps: int = 1, w_reg: float = 1.0,
              w_cls: float = 0.1, decay: float = 0.8, noise: float = 0.0,
              dropout: float = 0.0):
  """-> step(head, opt_state, batch); batch carries a "key" for the feature noise
  and dropout (raw key data, `jax.random.key_data`). dropout: the rate at which
  the (fused) target features' entries are zeroed (the rest scaled by
  1 / (1 - rate)); evaluation never drops.
  The frozen target weights (and the reduced vocabulary) are jit arguments."""
  if not 0.0 <= dropout < 1.0:
    raise ValueError(f"feature dropout must be in [0, 1), got {dropout}")
  @jax.jit
  def step_impl(head, opt_state, batch, target_params, vocab):
    key = jax.random.wrap_key_data(batch.pop("key"))
    shape = batch["tokens"].shape + (cfg.dim,)
    nz = None
    if noise:
      nz = jax.random.uniform(key, shape, jnp.float32, -noise, noise)
    keep = None
    if dropout:
      keep = jax.random.bernoulli(jax.random.fold_in(key, 1), 1.0 - dropout, shape).astype(
          jnp.float32) / (1.0 - dropout)
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        head, target_params, cfg, batch, vocab, nz, steps=steps, w_reg=w_reg, w_cls=w_cls,
        decay=decay, keep=keep)
    updates, opt_state = optimizer.update(grads, opt_state, head)
    head = jax.tree.map(lambda p, u: p + u, head, updates)
    metrics["positions"] = jnp.sum(batch["answer"]).astype(jnp.int32)
    return head, opt_state, metrics

  def step(head, opt_state, batch):
    return step_impl(head, opt_state, dict(batch), target_params, vocab)
  return step


@functools.partial(jax.jit, static_argnums=1)
def _target_stats(target_params, cfg, f_next):
  """The target's greedy token and log-normaliser log sum exp(logits) at each
  position, over the full vocabulary: what the estimate needs of the target's
  distribution besides its draft-vocabulary probabilities."""
  logits = transformer.lm_head(target_params, cfg, f_next)
  return jnp.argmax(logits, -1).astype(jnp.int32), jax.nn.logsumexp(logits, -1)


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def _eval_batch(head, target_params, cfg, batch, vocab, steps):
  """-> (greedy agreement, overlap sum min(p, q)) (B, T, steps) of the unrolled
  chain. With a reduced vocabulary and the windows' stored `_target_stats`
  ("tgt", "lse"), p over the draft vocabulary is exp(its logits - lse): the
  full 49,152-row LM head is not run again at every evaluation."""
  lm_w = eagle.head_weights(dict(head, **({} if vocab is None else {"vocab": vocab})),
                            target_params, cfg)
  outs = unroll(head, target_params, cfg, batch, steps)
  if vocab is not None and "lse" in batch:
    tgt = batch["tgt"]
    rows = eagle.head_weights({"vocab": vocab}, target_params, cfg)  # the target's, at vocab
    p_sub = jnp.exp(transformer._dot(batch["f_next"], rows) - batch["lse"][..., None])  # pylint: disable=protected-access
  else:
    _, p = target_probs(target_params, cfg, batch["f_next"], None)
    tgt = jnp.argmax(p, -1)
    p_sub = p if vocab is None else jnp.take(p, vocab, axis=-1)
  correct, overlap = [], []
  for a in outs:
    logits = eagle.draft_logits(head, target_params, cfg, a, lm_w)
    q_sub = jax.nn.softmax(logits, -1)
    top = jnp.argmax(logits, -1) if vocab is None else vocab[jnp.argmax(logits, -1)]
    correct.append(top == tgt)
    overlap.append(jnp.sum(jnp.minimum(p_sub, q_sub), -1))
  return jnp.stack(correct, -1), jnp.stack(overlap, -1)  # (B, T, steps)


def _estimate_group(head, target_params, cfg, windows, k, vocab, batch_size, corr, over, walks):
  """Append the per-chain agreement / overlap of `windows` (one width), and
  each window's greedy decoding walk (tokens, rounds: `theory.greedy_rounds`)."""
  for s in range(0, len(windows), batch_size):
    chunk = list(windows[s:s + batch_size])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_size - real)
    b = {key: jnp.asarray(np.stack([w[key] for w in chunk])) for key in chunk[0] if key != "d"}
    c, o = _eval_batch(head, target_params, cfg, b, vocab, k)
    c, o = np.asarray(c)[:real], np.asarray(o)[:real]
    ans = np.stack([w["answer"] for w in chunk[:real]])
    t = ans.shape[1]
    steps = np.arange(k)
    if t < k:  # no whole chain fits a window this narrow
      continue
    # fits[b, i]: a whole chain started at window index i lies in row b's answer
    fits = np.stack([ans[:, i:i + k].all(1) for i in range(t - k + 1)], 1)
    for i in range(t - k + 1):  # the chain started at window index i: step s sits at i + s
      corr += c[fits[:, i]][:, i + steps, steps].tolist()
      over += o[fits[:, i]][:, i + steps, steps].tolist()
    for r in range(real):
      starts = np.nonzero(fits[r])[0]
      if len(starts):
        walks.append(theory.greedy_rounds(c[r][starts[:, None] + steps, steps]))


def estimate(head, target_params, cfg, windows: Sequence[dict], k: int, vocab=None,
             batch_size: int = 8) -> Dict[str, float]:
  """Teacher-forced acceptance of a k-chain (module docstring) over `windows`.

  With a reduced vocabulary, each window keeps the target's greedy tokens and
  log-normalisers (`_target_stats`, keys "tgt" / "lse") from its first
  estimate: a training run that evaluates the same windows every `eval_every`
  steps runs the target's full LM head over them once. (A window's features
  are one target's, so its stored stats are that target's too.)"""
  if vocab is not None:
    for w in windows:
      if "lse" not in w:
        tgt, lse = _target_stats(target_params, cfg, jnp.asarray(w["f_next"]))
        w["tgt"], w["lse"] = np.asarray(tgt), np.asarray(lse)
  corr, over, walks = [], [], []
  groups: Dict[int, List[dict]] = {}
  for w in windows:  # windows of one width are evaluated together
    groups.setdefault(len(w["tokens"]), []).append(w)
  for _, group in sorted(groups.items()):
    _estimate_group(head, target_params, cfg, group, k, vocab, batch_size, corr, over, walks)
  if not corr:
    return {"tau": 1.0, "tau_t1": 1.0, "tau_rounds": 1.0}
  corr, over = np.asarray(corr, np.float64), np.asarray(over, np.float64)
  out = {"tau": float(1 + np.cumprod(corr, 1).sum(1).mean()),
         "tau_t1": float(1 + np.cumprod(over, 1).sum(1).mean()),
         "tau_rounds": float(sum(w[0] for w in walks) / sum(w[1] for w in walks))}
  for s in range(k):
    out[f"top1_{s}"] = float(corr[:, s].mean())
    out[f"alpha_{s}"] = float(over[:, s].mean())
  out["chains"] = float(len(corr))
  return out
