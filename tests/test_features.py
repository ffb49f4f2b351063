"""Drafter-training features (specjax.training.features): the teacher's top-K
distributions, content-keyed shards that grow with the data, the target's
dtype on disk (memory-mapped), and training labels from top-K equal to the
full distribution's when K covers the vocabulary."""

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import tiny_config
from specjax.training import eagle_train, features

CFG = tiny_config(eos_id=-1)
PARAMS = transformer.init(jax.random.key(4), CFG)
SEQS = [([5, 9, 3, 17, 4, 8, 2, 7], 3), ([8, 8, 30, 1, 2], 2), ([4, 4, 4, 6, 7, 9, 1], 4),
        ([3, 1, 4, 1, 5, 9, 2, 6, 5], 5), ([2, 7, 1, 8, 2], 1)]
KW = dict(seq_len=16, taps=(0, 1), batch_size=2)


@jax.jit
def _full_probs(tok):
  """softmax(logits) at every position of (1, 16) padded tokens, by a plain forward."""
  cache = cache_lib.init_cache(CFG, 1, 16)
  pos = transformer.chain_positions(cache, 16)
  logits, _, _ = transformer.forward(PARAMS, CFG, tok, pos, cache)
  return jax.nn.softmax(logits[0].astype(jnp.float32), -1)


@functools.partial(jax.jit, static_argnames=("with_top",))
def _labels_and_loss(head, batch, vocab, with_top):
  """(target_probs' labels, top-K labels, the loss) of one batch."""
  sub, _ = eagle_train.target_probs(PARAMS, CFG, batch["f_next"], vocab)
  dense = eagle_train.teacher_from_top_k(batch["p_ids"], batch["p_top"], vocab, CFG.vocab_size)
  b = batch if with_top else {k: v for k, v in batch.items() if k not in ("p_ids", "p_top")}
  loss, _ = eagle_train.loss_fn(head, PARAMS, CFG, b, vocab, None, steps=2, w_reg=0.0, w_cls=1.0,
                                decay=0.8)
  return sub, dense, loss


def test_top_k_teacher_is_the_targets_distribution():
  f = features.compute(PARAMS, CFG, SEQS, top_k=8, **KW)
  assert len(f["tokens"]) == len(SEQS)
  for ids, top_ids, top_p in zip(f["tokens"], f["top_ids"], f["top_p"]):
    tok = np.zeros((1, 16), np.int32)
    tok[0, :len(ids)] = ids
    p = np.asarray(_full_probs(jnp.asarray(tok)))[:len(ids)]
    want = np.argsort(-p, -1, kind="stable")[:, :8]
    np.testing.assert_array_equal(top_ids, want)
    np.testing.assert_allclose(top_p, np.take_along_axis(p, want, -1), rtol=1e-5, atol=1e-7)


def test_shards_are_keyed_by_content_and_only_new_data_is_computed(tmp_path):
  msgs = []
  kw = dict(KW, top_k=4, cache_dir=str(tmp_path), shard_sequences=2, progress=msgs.append)
  a = features.build(PARAMS, CFG, SEQS, **kw)
  assert len([p for p in os.listdir(tmp_path) if p.startswith("shard-")]) == 3
  assert "0 shards loaded, 3 computed" in msgs[-1]
  plain = features.compute(PARAMS, CFG, SEQS, top_k=4, **KW)
  for name in ("tokens", "final", "taps", "top_ids", "top_p"):
    for x, y in zip(a[name], plain[name]):
      np.testing.assert_array_equal(x, y)
  assert a["plen"] == plain["plen"]
  assert isinstance(a["final"][0].base, np.memmap) or isinstance(a["final"][0], np.memmap)
  # one more sequence: the first two shards are read, the last (now 2 sequences) computed
  msgs.clear()
  features.build(PARAMS, CFG, SEQS + [([6, 6, 1, 2, 3], 2)], **kw)
  assert "2 shards loaded, 1 computed" in msgs[-1]
  # other settings (top_k) never hit a stale shard
  msgs.clear()
  features.build(PARAMS, CFG, SEQS, **dict(kw, top_k=2))
  assert "0 shards loaded, 3 computed" in msgs[-1]
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_bf16_target_stores_bf16_features(tmp_path):
  cfg = tiny_config(eos_id=-1, dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  pool = eagle_train.SeqPool.build(params, cfg, SEQS, top_k=4, cache_dir=str(tmp_path), **KW)
  assert pool.final[0].dtype == ml_dtypes.bfloat16 and pool.taps[0].dtype == ml_dtypes.bfloat16
  w = pool.window(0, 0, 8)
  assert w["g"].dtype == np.float32 and w["f_next"].dtype == np.float32
  np.testing.assert_array_equal(w["f_next"][:7], np.asarray(pool.final[0][1:8], np.float32))
  np.testing.assert_array_equal(w["p_ids"][:7], pool.top_ids[0][1:8])
  assert 0.5 < pool.covered_mass() <= 1.0 + 1e-6


def test_top_k_labels_equal_the_full_distribution_when_k_covers_the_vocabulary():
  kw3 = dict(KW, taps=eagle_train.eagle.eagle3_layers(CFG))  # an EAGLE-3 head's inputs
  pool = eagle_train.SeqPool.build(PARAMS, CFG, SEQS, top_k=CFG.vocab_size, **kw3)
  np.testing.assert_allclose(pool.covered_mass(), 1.0, rtol=1e-5)
  batch = {k: jnp.asarray(v) for k, v in pool.sequence_batch(np.random.default_rng(0), 128).items()}
  vocab = jnp.arange(0, CFG.vocab_size, 2)
  head = eagle_train.eagle.init_head(jax.random.key(0), CFG, fused=True)
  keep = np.asarray(batch["in_seq"])[..., None] > 0
  for v in (None, vocab):
    sub, dense, _ = _labels_and_loss(head, batch, v, True)
    np.testing.assert_allclose(np.where(keep, dense, 0), np.where(keep, sub, 0), atol=2e-6)
  _, _, a = _labels_and_loss(head, batch, vocab, False)
  _, _, b = _labels_and_loss(head, batch, vocab, True)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  # a truncated teacher (top-2) is a different label: the loss moves
  small = eagle_train.SeqPool.build(PARAMS, CFG, SEQS, top_k=2, **kw3)
  sb = {k: jnp.asarray(v) for k, v in small.sequence_batch(np.random.default_rng(0), 128).items()}
  _, _, c = _labels_and_loss(head, sb, vocab, True)
  assert abs(float(c) - float(a)) > 1e-3


@functools.partial(jax.jit, static_argnames=("w_reg",))
def _loss_and_grads(head, batch, vocab, w_reg):
  f = functools.partial(eagle_train.loss_fn, target_params=PARAMS, cfg=CFG, batch=batch,
                        vocab=vocab, noise=None, steps=2, w_reg=w_reg, w_cls=1.0, decay=0.8)
  return jax.value_and_grad(f, has_aux=True)(head)


def test_gathered_loss_positions_change_no_loss_and_no_gradient():
  """`sequence_batch`'s `loss_rows` (the LM head run on the loss's positions
  only) gives the loss, metrics and gradients of the whole (B, T) batch."""
  kw3 = dict(KW, taps=eagle_train.eagle.eagle3_layers(CFG))
  pool = eagle_train.SeqPool.build(PARAMS, CFG, SEQS, top_k=8, **kw3)
  batch = {k: jnp.asarray(v) for k, v in pool.sequence_batch(np.random.default_rng(0), 128).items()}
  assert batch["loss_rows"].shape[0] < batch["tokens"].size  # the batch is gathered
  whole = {k: v for k, v in batch.items() if not k.startswith("loss_rows")}
  head = eagle_train.eagle.init_head(jax.random.key(1), CFG, fused=True)
  vocab = jnp.arange(0, CFG.vocab_size, 2)
  for w_reg in (0.0, 1.0):  # EAGLE-3 (no regression) and EAGLE's smooth-L1 term
    (la, ma), ga = _loss_and_grads(head, batch, vocab, w_reg)
    (lb, mb), gb = _loss_and_grads(head, whole, vocab, w_reg)
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
    for k in mb:
      np.testing.assert_allclose(float(ma[k]), float(mb[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), ga, gb)
  # negative control: dropping one loss position from the gather moves the loss
  cut = dict(batch, loss_rows_on=batch["loss_rows_on"].at[0].set(0.0))
  (lc, _), _ = _loss_and_grads(head, cut, vocab, 0.0)
  (la, _), _ = _loss_and_grads(head, batch, vocab, 0.0)
  assert abs(float(lc) - float(la)) > 1e-4


def test_a_run_without_taps_reads_the_shards_of_a_run_with_them(tmp_path):
  """A draft model (no taps) trains on the shards an EAGLE-3 run of the same
  data left: same tokens, final features and teacher top-K, taps not read;
  without `reuse_taps` it computes its own."""
  msgs = []
  kw = dict(KW, top_k=4, cache_dir=str(tmp_path), shard_sequences=2, progress=msgs.append)
  with_taps = features.build(PARAMS, CFG, SEQS, **kw)
  msgs.clear()
  reused = features.build(PARAMS, CFG, SEQS, **dict(kw, taps=(), reuse_taps=[KW["taps"]]))
  assert "3 shards loaded, 0 computed" in msgs[-1]
  own = features.compute(PARAMS, CFG, SEQS, top_k=4, **dict(KW, taps=()))
  assert reused["taps"] == [None] * len(SEQS) and reused["plen"] == own["plen"]
  for name in ("tokens", "top_ids"):
    for x, y, z in zip(reused[name], with_taps[name], own[name]):
      np.testing.assert_array_equal(x, y)
      np.testing.assert_array_equal(x, z)
  for name in ("final", "top_p"):
    for x, z in zip(reused[name], own[name]):
      np.testing.assert_allclose(x, z, rtol=1e-5, atol=1e-6)
  msgs.clear()
  features.build(PARAMS, CFG, SEQS, **dict(kw, taps=()))  # no reuse: its own shards
  assert "0 shards loaded, 3 computed" in msgs[-1]
  with pytest.raises(ValueError, match="without taps only"):
    features.build(PARAMS, CFG, SEQS, **dict(kw, reuse_taps=[(0,)]))


def test_draft_model_loss_from_top_k_equals_the_full_distributions():
  """The draft model's distillation loss (KL and TV) with the stored top-K
  teacher equals the one through the target's LM head when K covers the
  vocabulary, full or reduced draft vocabulary; the sequence loss mask
  covers the prompt positions too."""
  from specjax.drafters import draft_model  # pylint: disable=import-outside-toplevel
  from specjax.training import draft_train  # pylint: disable=import-outside-toplevel
  pool = eagle_train.SeqPool.build(PARAMS, CFG, SEQS, top_k=CFG.vocab_size, seq_len=16,
                                   batch_size=2)
  scfg = draft_model.student_config(CFG, 1)
  student = draft_train.init_student(PARAMS, CFG, (0,))
  order = draft_train.length_order(pool)
  top = draft_train._padded_batch(pool, order[:4], 4, 16)  # pylint: disable=protected-access
  full = draft_train._padded_batch(pool, order[:4], 4, 16, teacher=False)  # pylint: disable=protected-access
  np.testing.assert_array_equal(top["tokens"], full["tokens"])
  assert "p_ids" in top and "f" not in top and "f" in full and "p_ids" not in full
  loss_fn = jax.jit(functools.partial(draft_train.loss_fn, target_params=PARAMS, cfg=CFG,
                                      scfg=scfg), static_argnames=("loss",))
  for vocab in (None, jnp.arange(0, CFG.vocab_size, 2)):
    for loss in ("kl", "tv"):
      a, ma = loss_fn(student, batch=top, vocab=vocab, loss=loss)
      b, mb = loss_fn(student, batch=full, vocab=vocab, loss=loss)
      np.testing.assert_allclose(float(a), float(b), rtol=1e-4)
      np.testing.assert_allclose(float(ma["acc"]), float(mb["acc"]))
  assert pool.train_on_sequence() == 0  # the tiny sequences share no head
  seq = draft_train._padded_batch(pool, order[:4], 4, 16)  # pylint: disable=protected-access
  assert (seq["loss"] >= seq["answer"]).all() and seq["loss"].sum() > seq["answer"].sum()
