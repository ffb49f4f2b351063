"""Decontamination: no training example shares a 13-gram with an evaluation
prompt or reference (Spec-Bench, GSM8K test), and the evaluation files are
never a training source."""

import json
import os

import pytest

from specjax.training import decontaminate as dc
from specjax.training import distill_data as dd


@pytest.fixture(scope="module")
def index():
  return dc.eval_index(dd.DATA_DIR)


def _spec_bench():
  with open(os.path.join(dd.DATA_DIR, "spec_bench", "question_excl_mtbench.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_every_evaluation_prompt_is_caught(index):
  assert index.sources == {"spec_bench": 400, "gsm8k_test": 1319}
  for rec in _spec_bench():
    assert index.contaminated(rec["turns"][0]), rec["question_id"]
  # Spec-Bench's math questions are GSM8K test questions: the same text caught
  with open(os.path.join(dd.DATA_DIR, "gsm8k", "test.jsonl")) as f:
    questions = [json.loads(line)["question"] for line in f]
  assert all(index.contaminated(q) for q in questions)


def test_edited_copies_are_caught_while_13_words_survive(index):
  article = next(r for r in _spec_bench() if r["category"] == "summarization")["turns"][0]
  ws = article.split()
  assert len(ws) > 200
  # One word in 20 replaced, wrapped in other text, other case: caught.
  every20 = " ".join("zzz" if i % 20 == 7 else w for i, w in enumerate(ws))
  assert index.contaminated("Please read this.\n" + every20.upper() + "\nThanks!")
  # One word in 10 replaced: no 13 consecutive words are left; what a
  # 13-gram filter cannot see (stated in the module's docstring).
  every10 = " ".join("zzz" if i % 10 == 7 else w for i, w in enumerate(ws))
  assert not index.contaminated(every10)
  # a short evaluation text (under 13 words) is caught only verbatim
  qa = min((r["turns"][0] for r in _spec_bench()), key=lambda t: len(dc.words(t)))
  assert len(dc.words(qa)) < dc.N and index.contaminated(qa.upper() + " ")
  assert not index.contaminated(qa + " please")


def test_training_sources_are_clean(index):
  eval_files = {rel for rel, _ in dc.EVAL_SOURCES.values()}
  assert not eval_files & {rel for rel, _ in dd.SOURCES.values()}
  raw = dd.load_instructions(list(dd.SOURCES), decontaminate=False)
  clean = dd.load_instructions(list(dd.SOURCES))
  dropped = sorted(set(dict(raw)) - set(dict(clean)))
  # GSM8K's train split holds a few near-copies of test questions (the same
  # problem with other names and numbers): they are dropped, nothing else is.
  assert dropped and all(d.startswith("gsm8k_train/") for d in dropped), dropped
  assert len(dropped) < 20, dropped
  assert not any(index.contaminated(text) for _, text in clean)
  assert {eid.split("/")[0] for eid, _ in clean} == set(dd.SOURCES)


def test_unknown_or_missing_evaluation_source_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="unknown evaluation source 'mtbench'"):
    dc.eval_index(dd.DATA_DIR, ["mtbench"])
  with pytest.raises(FileNotFoundError, match="spec_bench"):
    dc.eval_index(str(tmp_path))
