"""Distilling a small independent draft model from the target (DistillSpec-style).

The student is a Llama-family model with the target's tokenizer, width and
heads but few layers: its decoder layers start as copies of some of the
target's (`init_layers`, by default its lowest ones), its embedding and
tied LM head are the target's own, frozen and referenced (not copied) by the
checkpoint. Only its layers and final norm train.

Data: the target's self-distilled answers (and optionally the datasets'
reference answers), one target forward per sequence into a host pool of the
target's final normed hidden states f_j (`eagle_train.SeqPool`), reused by
every epoch; the teacher distribution p_j = softmax(LMHead(f_j)) (the
distribution of token j+1, at temperature 1) is recomputed in each step from f
(one LM-head product), or, with `teacher_top_k` = K, read from the top-K ids
and probabilities stored with the features (no target LM head in a step; the
mass outside the top K is dropped). Validation always uses the full
distribution. The draft model needs no taps, so the shards an EAGLE-3 run of
the same data computed serve it (`features.build(reuse_taps=...)`).

Batches: `batch_seqs` whole sequences of similar length (neighbours in the
length-sorted pool), padded to a multiple of 64, run causally from position 0
like the drafter runs them; the loss counts the positions whose next token is
an answer token (with loss_positions='sequence', every position after the chat
template's shared head: the teacher's distribution is a label there too, and
the forward runs over the prompt anyway).

Losses (`loss`): "kl" forward KL(p || q) (the soft-label cross-entropy up to
p's entropy); "tv" the total variation 1/2 sum |p - q| = 1 - sum min(p, q)
(one minus the expected acceptance at T = 1, the quantity DistillSpec found
best aligned with speculative decoding); "kl+tv" both. With a reduced draft
vocabulary q lives on its tokens: KL is taken against p restricted to them,
and TV counts p's mass outside as lost.

Estimate (validation): per position, greedy agreement argmax q == argmax p
and sum_x min(p, q) at T = 1, both teacher-forced; the implied tau of a
k-chain is 1 + mean_c sum_m prod_{s<m} (agreement at c + s). For the target's
own greedy answers this is exactly what greedy drafting sees while it keeps
being accepted; elsewhere it is the usual teacher-forced approximation.
tau_rounds walks each answer as greedy decoding does (`theory.greedy_rounds`):
tokens / rounds, what a greedy benchmark measures on that text.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.analysis import theory
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig
from specjax.drafters.draft_model import assemble
from specjax.training import eagle_train

LOSSES = ("kl", "tv", "kl+tv")


def default_init_layers(target_layers: int, num_layers: int) -> tuple:
  """The target's first num_layers layers. (Measured on SmolLM2, 4 layers,
  teacher-forced top-1 agreement with the target before training: first four
  0.036; the first three + the last, or evenly spread layers, 0.000.)"""
  if not 1 <= num_layers <= target_layers:
    raise ValueError(f"a draft model needs 1..{target_layers} layers, got {num_layers}")
  return tuple(range(num_layers))


def parse_init_layers(spec, target_layers: int, num_layers: int) -> tuple:
  """'' / None: `default_init_layers`; else comma-separated target layer indices."""
  if spec is None or str(spec).strip() == "":
    return default_init_layers(target_layers, num_layers)
  try:
    layers = tuple(int(x) for x in str(spec).split(","))
  except ValueError:
    raise ValueError(f"init_layers {spec!r}: expected comma-separated layer indices") from None
  if len(layers) != num_layers:
    raise ValueError(f"init_layers {spec!r} names {len(layers)} layers; the draft model has "
                     f"{num_layers}")
  bad = [i for i in layers if not 0 <= i < target_layers]
  if bad:
    raise ValueError(f"init_layers {spec!r}: layers {bad} outside the target's 0..{target_layers - 1}")
  return layers


def init_student(target_params, cfg: ModelConfig, layers: Sequence[int]) -> dict:
  """Trainable part of the draft model: copies of the target's `layers` and final norm."""
  copy = lambda x: jnp.array(x, dtype=jnp.float32)  # pylint: disable=unnecessary-lambda-assignment
  return {"layers": [jax.tree.map(copy, target_params["layers"][i]) for i in layers],
          "final_norm": copy(target_params["final_norm"])}


def lm_weights(target_params, cfg: ModelConfig, vocab=None) -> jax.Array:
  w = target_params["embed"] if cfg.tie_embeddings else target_params["lm_head"]
  return w if vocab is None else jnp.take(w, vocab, axis=0)


def student_logits(student, target_params, cfg: ModelConfig, scfg: ModelConfig, tokens,
                   vocab=None):
  """Causal forward of the student over (B, T) tokens -> float32 logits (B, T, V or Vd)."""
  b, t = tokens.shape
  params = assemble(student, target_params, cfg)
  cache = cache_lib.init_cache(scfg, b, t, dtype=jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, hidden, _ = transformer.forward(params, scfg, tokens, pos, cache, compute_logits=False)
  return transformer.lm_head({"embed": lm_weights(target_params, cfg, vocab)},
                             cfg.replace(tie_embeddings=True), hidden)


def divergences(p, logq, vocab=None):
  """Per position: (kl, tv, overlap = sum min(p, q)) with q = exp(logq) on the
  draft vocabulary (all of it when vocab is None)."""
  p_sub = p if vocab is None else jnp.take(p, vocab, axis=-1)
  q = jnp.exp(logq)
  kl = jnp.sum(jnp.where(p_sub > 0, p_sub * (jnp.log(jnp.maximum(p_sub, 1e-30)) - logq), 0.0),
               -1)
  overlap = jnp.sum(jnp.minimum(p_sub, q), -1)
  return kl, 1.0 - overlap, overlap


def loss_fn(student, target_params, cfg, scfg, batch, vocab, loss: str):
  logits = student_logits(student, target_params, cfg, scfg, batch["tokens"], vocab)
  logq = jax.nn.log_softmax(logits, -1)
  if "p_ids" in batch:  # the stored top-K teacher distributions: no target LM head here
    p_sub = eagle_train.teacher_from_top_k(batch["p_ids"], batch["p_top"], vocab,
                                           cfg.vocab_size)
    kl, tv, _ = divergences(jax.lax.stop_gradient(p_sub), logq, None)
    target_tok = batch["p_ids"][..., 0]
  else:
    p = jax.lax.stop_gradient(eagle_train.target_probs(target_params, cfg, batch["f"])[1])
    kl, tv, _ = divergences(p, logq, vocab)
    target_tok = jnp.argmax(p, -1)
  mask = batch.get("loss", batch["answer"])  # the positions trained on
  denom = jnp.maximum(jnp.sum(mask), 1.0)
  per = {"kl": kl, "tv": tv, "kl+tv": kl + tv}[loss]
  total = jnp.sum(per * mask) / denom
  top = jnp.argmax(logits, -1)
  top = top if vocab is None else vocab[top]
  metrics = {"loss": total, "kl": jnp.sum(kl * mask) / denom, "tv": jnp.sum(tv * mask) / denom,
             "acc": jnp.sum((top == target_tok) * mask) / denom}
  return total, metrics


def make_step(optimizer, target_params, cfg: ModelConfig, scfg: ModelConfig, *, vocab=None,
              loss: str = "kl"):
  """-> step(student, opt_state, batch). The frozen target weights are jit arguments."""
  if loss not in LOSSES:
    raise ValueError(f"unknown distillation loss {loss!r} (known: {', '.join(LOSSES)})")

  @jax.jit
  def step_impl(student, opt_state, batch, target_params, vocab):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        student, target_params, cfg, scfg, batch, vocab, loss)
    updates, opt_state = optimizer.update(grads, opt_state, student)
    student = jax.tree.map(lambda p, u: p + u, student, updates)
    metrics["positions"] = jnp.sum(batch["answer"]).astype(jnp.int32)
    return student, opt_state, metrics

  def step(student, opt_state, batch):
    return step_impl(student, opt_state, batch, target_params, vocab)
  return step


def _row(pool, i: int, width: int, teacher: bool = True) -> dict:
  """Sequence i padded to `width`: tokens, the final features f (the full
  teacher distribution), or with `teacher` and a pool holding them the stored
  top-K teacher distributions (p_ids, p_top; then no f), the answer mask and,
  when the pool trains on more than the answer (`SeqPool.train_on_sequence`),
  the loss mask."""
  tok, plen = pool.tokens[i], pool.plen[i]
  n = min(len(tok), width)
  toks = np.zeros(width, np.int32)
  toks[:n] = tok[:n]
  j = np.arange(width)
  # position j predicts token j + 1, which must exist and be an answer token
  out = {"tokens": toks, "answer": ((j + 1 < n) & (j + 1 >= plen)).astype(np.float32)}
  if teacher and pool.top_ids is not None:
    k = pool.top_ids[i].shape[1]
    out["p_ids"] = np.zeros((width, k), np.int32)
    out["p_top"] = np.zeros((width, k), np.float32)
    out["p_ids"][:n] = pool.top_ids[i][:n]
    out["p_top"][:n] = pool.top_p[i][:n]
  else:
    f = pool.final[i]
    out["f"] = np.zeros((width, f.shape[1]), np.float32)
    out["f"][:n] = f[:n]
  if pool.loss_start is not None:
    out["loss"] = ((j + 1 < n) & (j + 1 >= pool.loss_start[i])).astype(np.float32)
  return out


def _padded_batch(pool, idx, batch_seqs: int, max_len: int, teacher: bool = True) -> dict:
  """Sequences `idx` (repeating the last up to `batch_seqs` rows), padded to a
  multiple of 64 (at most `max_len`)."""
  idx = [int(i) for i in idx]
  idx += [idx[-1]] * (batch_seqs - len(idx))
  width = min(max_len, cache_lib.round_up(max(len(pool.tokens[i]) for i in idx), 64))
  rows = [_row(pool, i, width, teacher) for i in idx]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def sequence_batch(pool, order: np.ndarray, rng: np.random.Generator, batch_seqs: int,
                   max_len: int) -> dict:
  """`batch_seqs` sequences of similar length (consecutive in `order`, the
  length-sorted indices), padded to a multiple of 64 (at most `max_len`)."""
  start = int(rng.integers(0, max(len(order) - batch_seqs, 0) + 1))
  return _padded_batch(pool, order[start:start + batch_seqs], batch_seqs, max_len)


def length_order(pool) -> np.ndarray:
  return np.argsort([len(t) for t in pool.tokens], kind="stable")


@functools.partial(jax.jit, static_argnames=("cfg", "scfg"))
def _eval_batch(student, target_params, cfg, scfg, batch, vocab):
  logits = student_logits(student, target_params, cfg, scfg, batch["tokens"], vocab)
  _, p = eagle_train.target_probs(target_params, cfg, batch["f"])
  _, _, overlap = divergences(p, jax.nn.log_softmax(logits, -1), vocab)
  top = jnp.argmax(logits, -1)
  top = top if vocab is None else vocab[top]
  return top == jnp.argmax(p, -1), overlap


def estimate(student, target_params, cfg: ModelConfig, scfg: ModelConfig, pool, k: int,
             vocab=None, batch_seqs: int = 4, max_len: int = 384,
             max_seqs: Optional[int] = None) -> Dict[str, float]:
  """Teacher-forced acceptance of a k-chain over the pool's answers (module docstring)."""
  order = length_order(pool)
  if max_seqs:
    order = order[:max_seqs] if len(order) <= max_seqs else order[
        np.linspace(0, len(order) - 1, max_seqs).astype(int)]
  corr, over, walks = [], [], []
  for s in range(0, len(order), batch_seqs):
    real = len(order[s:s + batch_seqs])
    # the full teacher distribution (validation never uses the stored top-K)
    b = jax.tree.map(jnp.asarray, _padded_batch(pool, order[s:s + batch_seqs], batch_seqs,
                                                max_len, teacher=False))
    b.pop("loss", None)
    c, o = _eval_batch(student, target_params, cfg, scfg, b, vocab)
    c, o = np.asarray(c, np.float64)[:real], np.asarray(o, np.float64)[:real]
    ans = np.asarray(b["answer"])[:real] > 0
    for r in range(real):
      pos = np.nonzero(ans[r])[0]
      chains = [pos[st:st + k] for st in range(0, len(pos) - k + 1)]
      for chain in chains:
        corr.append(c[r, chain])
        over.append(o[r, chain])
      if chains:  # the greedy decoding walk over this answer (theory.greedy_rounds)
        walks.append(theory.greedy_rounds(c[r, np.stack(chains)] > 0))
  if not corr:
    return {"tau": 1.0, "tau_t1": 1.0, "tau_rounds": 1.0}
  corr, over = np.asarray(corr), np.asarray(over)
  out = {"tau": float(1 + np.cumprod(corr, 1).sum(1).mean()),
         "tau_t1": float(1 + np.cumprod(over, 1).sum(1).mean()),
         "tau_rounds": float(sum(w[0] for w in walks) / sum(w[1] for w in walks)),
         "top1": float(corr[:, 0].mean()), "alpha": float(over[:, 0].mean()),
         "chains": float(len(corr))}
  return out


def export_hf(checkpoint: str, target_model, out: str, *, dtype: Optional[str] = None,
              overwrite: bool = False) -> dict:
  """Write a distilled draft model as a standalone HF LlamaForCausalLM
  directory: its layers and final norm with the target's FULL embedding (and
  LM head) -- a model any HF-format loader runs on its own, and that
  `--config.draft_model=<out>` loads like any model. -> summary dict."""
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel
  from specjax.io import hf  # pylint: disable=import-outside-toplevel
  params, dcfg = registry.distilled_model(checkpoint, target_model, "full")
  params = {k: v for k, v in params.items() if k in ("embed", "layers", "final_norm", "lm_head")}
  if dtype:
    dcfg = dcfg.replace(dtype=dtype)
  hf.save_hf(out, jax.tree.map(np.asarray, params), dcfg, overwrite=overwrite)
  return {"out": out, "num_layers": dcfg.num_layers, "vocab_size": dcfg.vocab_size,
          "params": int(sum(np.size(x) for x in jax.tree.leaves(params))), "dtype": dcfg.dtype}
