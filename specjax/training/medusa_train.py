"""Training Medusa heads (and so blockwise parallel decoding) on the frozen
target's own answers.

Features: the target's final normed hidden states over (prompt + answer)
sequences, computed once by a target forward per batch of sequences and kept
in host memory as one flat pool (position j of the pool: hidden h_t, the next
token x_{t+1}, its sequence id). Every training epoch reuses the pool, so the
30-layer target forward runs once per sequence, not once per epoch (the
features of a batch cost ~3x a head step on the dev CPU).

Loss: head i at pool position j predicts x_{t+2+i} = next[j + 1 + i] (same
sequence only); cross-entropy through the target's frozen LM head, weighted
`decay**i` as in Medusa.

Cheap acceptance estimate (teacher-forced, validation pool): per head, top-1
agreement with the target's token, and alpha_i = sum_x min(p, q_i) at
temperature 1 with p the target's distribution at the guessed position; the
greedy chain's expected tokens per round for k heads,
tau_k = mean_j [1 + sum_{m=1..k} prod_{i<m} correct_i(j)].
"""

from __future__ import annotations

import functools
from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import medusa
from specjax.models import cache as cache_lib
from specjax.models import transformer


@functools.partial(jax.jit, static_argnames=("cfg",))
def _hidden(params, cfg, tokens):
  b, t = tokens.shape
  cache = cache_lib.init_cache(cfg, b, t)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, hidden, _ = transformer.forward(params, cfg, tokens, pos, cache, compute_logits=False)
  return hidden


class FeaturePool:
  """Flat pool of target features for the positions that predict answer tokens."""

  def __init__(self, hidden: np.ndarray, nxt: np.ndarray, seq: np.ndarray):
    self.hidden, self.nxt, self.seq = hidden, nxt, seq

  def __len__(self):
    return len(self.nxt)

  @classmethod
  def build(cls, params, cfg, sequences: Sequence[Tuple[List[int], int]], *, seq_len: int,
            batch_size: int = 4, progress=None) -> "FeaturePool":
    """sequences: (prompt + answer ids, prompt length); truncated to seq_len."""
    hs, nx, sq = [], [], []
    for s in range(0, len(sequences), batch_size):
      chunk = sequences[s:s + batch_size]
      toks = np.full((batch_size, seq_len), cfg.pad_id, np.int32)
      for i, (ids, _) in enumerate(chunk):
        ids = ids[:seq_len]
        toks[i, :len(ids)] = ids
      hid = np.asarray(_hidden(params, cfg, jnp.asarray(toks)), np.float32)
      for i, (ids, plen) in enumerate(chunk):
        n = min(len(ids), seq_len)
        lo, hi = max(plen - 1, 0), n - 1  # positions t whose next token is an answer token
        if hi <= lo:
          continue
        hs.append(hid[i, lo:hi])
        nx.append(np.asarray(ids[lo + 1:hi + 1], np.int32))
        sq.append(np.full(hi - lo, s + i, np.int32))
      if progress:
        progress(f"features: {min(s + batch_size, len(sequences))}/{len(sequences)} sequences")
    return cls(np.concatenate(hs), np.concatenate(nx), np.concatenate(sq))

  def labels(self, idx: np.ndarray, num_heads: int) -> Tuple[np.ndarray, np.ndarray]:
    """(labels (N, H), valid (N, H)) for pool positions idx: next[j + 1 + i]."""
    off = idx[:, None] + 1 + np.arange(num_heads)[None]
    inb = off < len(self.nxt)
    offc = np.where(inb, off, 0)
    valid = inb & (self.seq[offc] == self.seq[idx][:, None])
    return np.where(valid, self.nxt[offc], 0).astype(np.int32), valid

  def batch(self, idx: np.ndarray, num_heads: int) -> dict:
    labels, valid = self.labels(idx, num_heads)
    return {"h": self.hidden[idx], "labels": labels, "valid": valid.astype(np.float32)}


def loss_fn(heads, target_params, cfg, batch, decay: float):
  logits = medusa.head_logits(heads, target_params, cfg, batch["h"])  # (N, H, V)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]  # (N, H)
  w = batch["valid"] * (decay ** jnp.arange(nll.shape[1]))[None]
  loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
  correct = (jnp.argmax(logits, -1) == batch["labels"]) * batch["valid"]
  acc = jnp.sum(correct, 0) / jnp.maximum(jnp.sum(batch["valid"], 0), 1.0)
  return loss, acc


def make_step(optimizer, target_params, cfg, decay: float):
  """-> step(heads, opt_state, batch). The frozen target weights are an
  argument of the jitted function, not a closed-over constant (XLA would
  constant-fold transposes of the 113 MB LM head at compile time)."""
  @jax.jit
  def step_impl(heads, opt_state, batch, target_params):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads, target_params, cfg,
                                                                    batch, decay)
    updates, opt_state = optimizer.update(grads, opt_state, heads)
    heads = jax.tree.map(lambda p, u: p + u, heads, updates)
    metrics = {"loss": loss, "positions": batch["h"].shape[0]}
    metrics.update({f"acc{i}": acc[i] for i in range(acc.shape[0])})
    return heads, opt_state, metrics

  def step(heads, opt_state, batch):
    return step_impl(heads, opt_state, batch, target_params)
  return step


@functools.partial(jax.jit, static_argnames=("cfg",))
def _eval_chunk(heads, target_params, cfg, h, h_future, labels, valid):
  """Per position and head: top-1 correct, sum_x min(p, q) at T = 1."""
  logits = medusa.head_logits(heads, target_params, cfg, h)  # (N, H, V)
  q = jax.nn.softmax(logits, -1)
  p = jax.nn.softmax(transformer.lm_head(target_params, cfg, h_future), -1)  # (N, H, V)
  overlap = jnp.sum(jnp.minimum(p, q), -1) * valid
  correct = (jnp.argmax(logits, -1) == labels) & (valid > 0)
  return correct, overlap


def estimate(heads, target_params, cfg, pool: FeaturePool, num_heads: int,
             chunk: int = 256) -> Dict[str, float]:
  """Teacher-forced acceptance estimate on a pool (see the module docstring)."""
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
                       jnp.asarray(valid.astype(np.float32)))
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
