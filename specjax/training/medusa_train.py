"""Training Medusa heads (and so blockwise parallel decoding) on the frozen
target's own answers.

Features: the target's final normed hidden states over (prompt + answer)
sequences (`specjax.training.features`: computed once, or read from the shard
cache an EAGLE / EAGLE-3 / draft-model run of the same data left), kept in
host memory as one flat pool (position j of the pool: hidden h_t, the next
token x_{t+1}, its sequence id, and with a top-K teacher the target's top-K
distribution of x_{t+1}). Every training epoch reuses the pool, so the
30-layer target forward runs once per sequence, not once per epoch.

Loss: head i at pool position j predicts x_{t+2+i} = next[j + 1 + i] (same
sequence only), weighted `decay**i` as in Medusa: cross-entropy against that
token (Medusa-1), or with the stored top-K teacher against the target's own
distribution of it (soft labels, the self-distillation of Medusa-2), through
the target's frozen LM head -- or only its rows of a reduced draft vocabulary
(`vocab`: the heads' logits cover those tokens; hard labels outside it do not
count, soft labels keep their mass inside it).

Cheap acceptance estimate (teacher-forced, validation pool): per head, top-1
agreement with the target's token, and alpha_i = sum_x min(p, q_i) at
temperature 1 with p the target's distribution at the guessed position; the
greedy chain's expected tokens per round for k heads,
tau_k = mean_j [1 + sum_{m=1..k} prod_{i<m} correct_i(j)].
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle, medusa
from specjax.models import transformer
from specjax.training import eagle_train
from specjax.training import features as features_lib


class FeaturePool:
  """Flat pool of target features for the positions that predict answer tokens."""

  def __init__(self, hidden: np.ndarray, nxt: np.ndarray, seq: np.ndarray,
               top_ids: Optional[np.ndarray] = None, top_p: Optional[np.ndarray] = None):
    self.hidden, self.nxt, self.seq = hidden, nxt, seq
    self.top_ids, self.top_p = top_ids, top_p  # the teacher's top-K of nxt, or None

  def __len__(self):
    return len(self.nxt)

  def take(self, keep: np.ndarray) -> "FeaturePool":
    top = self.top_ids is not None
    return FeaturePool(self.hidden[keep], self.nxt[keep], self.seq[keep],
                       self.top_ids[keep] if top else None, self.top_p[keep] if top else None)

  @classmethod
  def from_features(cls, feats: Dict[str, list]) -> "FeaturePool":
    """From `features.build`'s per-sequence features: the positions t whose
    next token is an answer token."""
    hs, nx, sq, ti, tp = [], [], [], [], []
    for i, (ids, plen, final) in enumerate(zip(feats["tokens"], feats["plen"], feats["final"])):
      lo, hi = max(plen - 1, 0), len(ids) - 1
      if hi <= lo:
        continue
      hs.append(np.asarray(final[lo:hi], np.float32))
      nx.append(np.asarray(ids[lo + 1:hi + 1], np.int32))
      sq.append(np.full(hi - lo, i, np.int32))
      if feats["top_ids"][i] is not None:
        ti.append(np.asarray(feats["top_ids"][i][lo:hi], np.int32))
        tp.append(np.asarray(feats["top_p"][i][lo:hi], np.float32))
    top = len(ti) == len(hs) and bool(ti)
    return cls(np.concatenate(hs), np.concatenate(nx), np.concatenate(sq),
               np.concatenate(ti) if top else None, np.concatenate(tp) if top else None)

  @classmethod
  def build(cls, params, cfg, sequences: Sequence[Tuple[List[int], int]], *, seq_len: int,
            batch_size: int = 4, top_k: int = 0, cache_dir: Optional[str] = None,
            reuse_taps: Sequence[Tuple[int, ...]] = (), progress=None) -> "FeaturePool":
    """sequences: (prompt + answer ids, prompt length); truncated to seq_len.
    top_k: with the teacher's top-K distributions; cache_dir / reuse_taps:
    `features.build`'s shard cache (an EAGLE-3 run's shards serve)."""
    return cls.from_features(features_lib.build(
        params, cfg, sequences, seq_len=seq_len, top_k=top_k, batch_size=batch_size,
        cache_dir=cache_dir, reuse_taps=reuse_taps, progress=progress))

  def labels(self, idx: np.ndarray, num_heads: int) -> Tuple[np.ndarray, np.ndarray]:
    """(labels (N, H), valid (N, H)) for pool positions idx: next[j + 1 + i]."""
    labels, valid, _ = self._future(idx, num_heads)
    return labels, valid

  def _future(self, idx: np.ndarray, num_heads: int):
    off = idx[:, None] + 1 + np.arange(num_heads)[None]
    inb = off < len(self.nxt)
    offc = np.where(inb, off, 0)
    valid = inb & (self.seq[offc] == self.seq[idx][:, None])
    return np.where(valid, self.nxt[offc], 0).astype(np.int32), valid, offc

  def batch(self, idx: np.ndarray, num_heads: int, teacher: bool = False) -> dict:
    """teacher: with the teacher's top-K distribution of each head's label
    ("p_ids", "p_top" (N, H, K); needs a pool built with top_k)."""
    labels, valid, offc = self._future(idx, num_heads)
    out = {"h": self.hidden[idx], "labels": labels, "valid": valid.astype(np.float32)}
    if teacher:
      if self.top_ids is None:
        raise ValueError("soft labels need the teacher's top-K: build the pool with top_k > 0")
      out["p_ids"] = np.where(valid[..., None], self.top_ids[offc], 0).astype(np.int32)
      out["p_top"] = np.where(valid[..., None], self.top_p[offc], 0).astype(np.float32)
    return out


def _in_vocab(labels, vocab, vocab_size: int):
  """Hard labels -> (their index in the draft vocabulary (or themselves),
  whether the drafter can propose them)."""
  if vocab is None:
    return labels, jnp.ones(labels.shape, bool)
  col = eagle_train.vocab_index(vocab, vocab_size)[labels]
  return jnp.maximum(col, 0), col >= 0


def loss_fn(heads, target_params, cfg, batch, decay: float, vocab=None):
  lm_w = eagle.head_weights({} if vocab is None else {"vocab": vocab}, target_params, cfg)
  logits = medusa.head_logits(heads, target_params, cfg, batch["h"], lm_w=lm_w)  # (N, H, V|Vd)
  logp = jax.nn.log_softmax(logits, axis=-1)
  col, inside = _in_vocab(batch["labels"], vocab, cfg.vocab_size)
  if "p_ids" in batch:  # soft labels: the stored top-K teacher (mass outside the vocab dropped)
    p = eagle_train.teacher_from_top_k(batch["p_ids"], batch["p_top"], vocab, cfg.vocab_size)
    nll = -jnp.sum(jax.lax.stop_gradient(p) * logp, -1)  # (N, H)
    count = batch["valid"]
  else:
    nll = -jnp.take_along_axis(logp, col[..., None], axis=-1)[..., 0]  # (N, H)
    count = batch["valid"] * inside
  w = count * (decay ** jnp.arange(nll.shape[1]))[None]
  loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
  top = jnp.argmax(logits, -1)
  top = top if vocab is None else vocab[top]
  correct = (top == batch["labels"]) * batch["valid"]
  acc = jnp.sum(correct, 0) / jnp.maximum(jnp.sum(batch["valid"], 0), 1.0)
  return loss, acc


def make_step(optimizer, target_params, cfg, decay: float, vocab=None):
  """-> step(heads, opt_state, batch). The frozen target weights (and the
  reduced vocabulary) are arguments of the jitted function, not closed-over
  constants (XLA would constant-fold transposes of the 113 MB LM head at
  compile time)."""
  @jax.jit
  def step_impl(heads, opt_state, batch, target_params, vocab):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads, target_params, cfg,
                                                                    batch, decay, vocab)
    updates, opt_state = optimizer.update(grads, opt_state, heads)
    heads = jax.tree.map(lambda p, u: p + u, heads, updates)
    metrics = {"loss": loss, "positions": batch["h"].shape[0]}
    metrics.update({f"acc{i}": acc[i] for i in range(acc.shape[0])})
    return heads, opt_state, metrics

  def step(heads, opt_state, batch):
    return step_impl(heads, opt_state, batch, target_params, vocab)
  return step


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eval_chunk(heads, target_params, cfg, h, h_future, labels, valid, vocab):
  """Per position and head: top-1 correct, sum_x min(p, q) at T = 1 (q zero
  off a reduced draft vocabulary, p the target's full distribution)."""
  lm_w = eagle.head_weights({} if vocab is None else {"vocab": vocab}, target_params, cfg)
  logits = medusa.head_logits(heads, target_params, cfg, h, lm_w=lm_w)  # (N, H, V|Vd)
  q = jax.nn.softmax(logits, -1)
  p_sub, _ = eagle_train.target_probs(target_params, cfg, h_future, vocab)  # (N, H, V|Vd)
  overlap = jnp.sum(jnp.minimum(p_sub, q), -1) * valid
  top = jnp.argmax(logits, -1)
  top = top if vocab is None else vocab[top]
  correct = (top == labels) & (valid > 0)
  return correct, overlap


def estimate(heads, target_params, cfg, pool: FeaturePool, num_heads: int,
             chunk: int = 256, vocab=None) -> Dict[str, float]:
  """Teacher-forced acceptance estimate on a pool (see the module docstring);
  `vocab`: the heads' reduced draft vocabulary."""
  n = len(pool)
  cs, os_, vs = [], [], []
  for s in range(0, n, chunk):
    idx = np.arange(s, min(s + chunk, n))
    pad = chunk - len(idx)
    idx_p = np.pad(idx, (0, pad), mode="edge")
    labels, valid = pool.labels(idx_p, num_heads)
    fut = np.minimum(idx_p[:, None] + 1 + np.arange(num_heads)[None], n - 1)
    c, o = _eval_chunk(heads, target_params, cfg, jnp.asarray(pool.hidden[idx_p]),
                       jnp.asarray(pool.hidden[fut]), jnp.asarray(labels),
                       jnp.asarray(valid.astype(np.float32)), vocab)
    cs.append(np.asarray(c)[:len(idx)])
    os_.append(np.asarray(o)[:len(idx)])
    vs.append(valid[:len(idx)])
  correct, overlap, valid = (np.concatenate(x) for x in (cs, os_, vs))
  chain = np.cumprod(correct, axis=1)
  out = {"tau": float(1 + chain.sum(1).mean())}
  for i in range(num_heads):
    out[f"top1_{i}"] = float(correct[:, i].sum() / max(valid[:, i].sum(), 1))
    out[f"alpha_{i}"] = float(overlap[:, i].sum() / max(valid[:, i].sum(), 1))
  return out
