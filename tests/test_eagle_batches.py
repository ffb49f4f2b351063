"""EAGLE training batches: whole sequences from position 0 (the prefix the head
has in its cache while drafting), one length bucket per batch, buckets drawn in
proportion to their answer positions; validation over whole sequences."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specjax.training import eagle_train

D = 4
# (length, prompt length): buckets 64, 64, 128, 256, 256
SHAPES = [(30, 10), (50, 20), (100, 5), (200, 100), (256, 250)]


def _pool():
  rng = np.random.default_rng(0)
  tokens = [np.arange(n, dtype=np.int32) + 1000 * i for i, (n, _) in enumerate(SHAPES)]
  final = [rng.standard_normal((n, D)).astype(np.float32) for n, _ in SHAPES]
  return eagle_train.SeqPool(tokens, final, [None] * len(SHAPES), [p for _, p in SHAPES])


def test_sequence_batches_hold_whole_sequences_from_position_zero():
  pool = _pool()
  assert [pool.width(i) for i in range(len(SHAPES))] == [64, 64, 128, 256, 256]
  rng = np.random.default_rng(1)
  seen = set()
  for _ in range(40):
    b = pool.sequence_batch(rng, 256)
    rows, w = b["tokens"].shape
    assert w in (64, 128, 256) and rows == 256 // w
    for r in range(rows):
      i = int(b["tokens"][r, 0]) // 1000  # x_1 of sequence i is 1000 i + 1
      n, plen = SHAPES[i]
      seen.add(i)
      assert pool.width(i) == w
      j = np.arange(w)
      np.testing.assert_array_equal(b["positions"][r], j)
      np.testing.assert_array_equal(b["in_seq"][r], (j + 1 < n).astype(np.float32))
      np.testing.assert_array_equal(b["tokens"][r, :n - 1], pool.tokens[i][1:])
      np.testing.assert_array_equal(b["g"][r, :n - 1], pool.final[i][:n - 1])
      np.testing.assert_array_equal(b["f_next"][r, :n - 1], pool.final[i][1:])
      # the loss is on answer labels only; the prompt is attended to, not scored
      np.testing.assert_array_equal(b["answer"][r], ((j + 1 < n) & (j + 2 >= plen)))
  assert seen == set(range(len(SHAPES)))


def test_loss_positions_are_gathered_in_one_shape_per_bucket():
  """`loss_rows` lists the loss's positions of the flattened batch (the LM
  head runs on these only), padded to a size fixed per bucket that every
  batch of it fits; with the loss on the whole sequence the bound grows."""
  pool = _pool()
  want = {64: 128, 128: 192, 256: 128}  # rows x the bucket's most loss positions, to 64
  for seq_loss in (False, True):
    if seq_loss:
      pool.train_on_sequence()  # no shared head (the sequences differ at token 0):
      want = {64: None, 128: None, 256: None}  # 4 x 49, 2 x 99, 1 x 255 -> 256: nothing to save
    rng = np.random.default_rng(3)
    for _ in range(60):
      b = pool.sequence_batch(rng, 256)
      w = b["tokens"].shape[1]
      on = b.get("loss", b["answer"]).reshape(-1)
      if want[w] is None or want[w] >= b["tokens"].size:
        assert "loss_rows" not in b
        continue
      n = int(on.sum())
      assert b["loss_rows"].shape == (want[w],) and b["loss_rows"].dtype == np.int32
      np.testing.assert_array_equal(b["loss_rows"][:n], np.flatnonzero(on))
      np.testing.assert_array_equal(b["loss_rows_on"], np.arange(want[w]) < n)
  for i, (n, plen) in enumerate(SHAPES):  # the bound's count is the window's mask
    for start in (plen, 1, 0):
      for t in (64, 256):
        j = np.arange(t)
        count = int(np.sum((j + 1 < n) & (j + 2 >= start)))
        assert pool._window_loss_positions(i, start, t) == count  # pylint: disable=protected-access


def test_buckets_are_drawn_in_proportion_to_their_answer_positions():
  pool = _pool()
  answers = {64: (30 - 9 - 1) + (50 - 19 - 1), 128: 100 - 4 - 1,
             256: (200 - 99 - 1) + (256 - 249 - 1)}
  total = sum(answers.values())
  rng = np.random.default_rng(2)
  widths = [pool.sequence_batch(rng, 64)["tokens"].shape[1] for _ in range(3000)]
  for w, a in answers.items():  # 3000 draws: the standard error is below 0.01
    assert abs(widths.count(w) / 3000 - a / total) < 0.04, (w, widths.count(w), a / total)


def test_validation_sequences_are_whole_and_in_order():
  pool = _pool()
  wins = pool.eval_sequences()
  assert len(wins) == len(SHAPES)
  for i, (w, (n, plen)) in enumerate(zip(wins, SHAPES)):
    assert len(w["tokens"]) == pool.width(i)
    np.testing.assert_array_equal(w["positions"], np.arange(pool.width(i)))
    assert w["answer"].sum() == n - 1 - max(plen - 2, 0)  # labels x_plen .. x_{n-1}
  assert len(pool.eval_sequences(2)) == 2


def test_loss_on_the_sequence_covers_every_label_after_the_shared_head():
  # three sequences sharing a 3-token head (a chat template's system turn)
  shapes = [(12, 6), (20, 9), (9, 5)]
  rng = np.random.default_rng(3)
  tokens = [np.concatenate([[7, 8, 9], 100 * (i + 1) + np.arange(n - 3)]).astype(np.int32)
            for i, (n, _) in enumerate(shapes)]
  final = [rng.standard_normal((n, D)).astype(np.float32) for n, _ in shapes]
  pool = eagle_train.SeqPool(tokens, final, [None] * 3, [p for _, p in shapes])
  assert "loss" not in pool.window(0, 0, 64)  # default: the answer only
  assert pool.num_loss_positions == pool.num_positions
  assert pool.train_on_sequence() == 3
  for i, (n, plen) in enumerate(shapes):
    w = pool.window(i, 0, 64)
    j = np.arange(64)
    # the label x_{j+2} is past the shared head: j + 2 >= 3; prompt labels included
    np.testing.assert_array_equal(w["loss"], ((j + 1 < n) & (j + 2 >= 3)).astype(np.float32))
    # the answer mask (validation, epochs) is unchanged
    np.testing.assert_array_equal(w["answer"], ((j + 1 < n) & (j + 2 >= plen)))
    assert w["loss"].sum() > w["answer"].sum()
  assert pool.num_loss_positions == sum(n - 3 for n, _ in shapes)
  assert pool.num_positions == sum(n - plen for n, plen in shapes)


def test_buckets_drawn_by_loss_positions_and_pools_joined():
  """bucket_weight='loss': a bucket's share is its loss positions (the long
  prompts' included) -- the width of long sequences with short answers comes
  up as often as their positions; SeqPool.concat keeps every sequence in order."""
  shapes = [(40, 30), (40, 30), (250, 240)]  # widths 64, 64, 256; loss from label 3 on
  rng = np.random.default_rng(4)
  tokens = [np.concatenate([[7, 8, 9], 100 * (i + 1) + np.arange(n - 3)]).astype(np.int32)
            for i, (n, _) in enumerate(shapes)]
  final = [rng.standard_normal((n, D)).astype(np.float32) for n, _ in shapes]
  a = eagle_train.SeqPool(tokens[:2], final[:2], [None] * 2, [p for _, p in shapes[:2]])
  b = eagle_train.SeqPool(tokens[2:], final[2:], [None], [shapes[2][1]])
  pool = eagle_train.SeqPool.concat([a, b])
  assert len(pool) == 3 and pool.plen == [30, 30, 240]
  for i in range(3):
    np.testing.assert_array_equal(pool.tokens[i], tokens[i])
  pool.train_on_sequence()
  loss = {64: 2 * (40 - 3), 256: 250 - 3}
  answer = {64: 2 * (40 - 29 - 1), 256: 250 - 239 - 1}
  for weight, want in (("loss", loss), ("answer", answer)):
    pool.bucket_weight, pool._by_width = weight, None  # pylint: disable=protected-access
    r = np.random.default_rng(5)
    widths = [pool.sequence_batch(r, 256)["tokens"].shape[1] for _ in range(2000)]
    share = widths.count(256) / 2000
    assert abs(share - want[256] / sum(want.values())) < 0.04, (weight, share)
  pool.bucket_weight, pool._by_width = "positions", None  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="unknown bucket_weight"):
    pool.sequence_batch(np.random.default_rng(0), 256)
  from specjax.training import run  # pylint: disable=import-outside-toplevel
  from specjax.training.settings import TrainSettings  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="unknown bucket_weight 'positions'"):  # before any feature
    run.check_loss_positions(TrainSettings(method="eagle3", bucket_weight="positions"))
  top = eagle_train.SeqPool(tokens[:1], final[:1], [None], [30], top_ids=[np.zeros((40, 2))],
                            top_p=[np.zeros((40, 2))])
  with pytest.raises(ValueError, match="top-K"):
    eagle_train.SeqPool.concat([a, top])


def test_train_step_experiment_times_both_variants(tmp_path):
  """experiments/train_step.py end to end on the tiny model (a subprocess, as
  its docstring runs it): both variants timed on gathered batches."""
  rng = np.random.default_rng(0)
  data = tmp_path / "distill.jsonl"
  with open(data, "w") as f:
    for i in range(8):
      f.write(json.dumps({"id": f"alpaca/{i}", "split": "train",
                          "prompt": rng.integers(1, 64, int(rng.integers(4, 12))).tolist(),
                          "answer": rng.integers(1, 64, int(rng.integers(8, 24))).tolist()}) + "\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "step.json"
  proc = subprocess.run(
      [sys.executable, "experiments/train_step.py", "--config=configs/eagle3.py:tiny",
       f"--config.data_path={data}", "--records=8", "--steps=2", f"--out={out}"],
      cwd=root, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = json.loads(out.read_text())
  assert got["steps"] == 2 and got["gathered_median_s"] > 0 and got["full_median_s"] > 0
  assert got["mean_lm_head_rows"] < got["mean_slots"]  # the tiny answers leave slots to drop
