"""Self-distillation data on the real model: deterministic, resumable, split
by id; and the datasets' reference answers in the same record format."""

import dataclasses
import json
import re

import pytest

from specjax.errors import ConfigValueError, MalformedFileError
from specjax.training import distill_data

pytestmark = pytest.mark.slow  # the real model

SOURCES = ["alpaca", "gsm8k_train"]


def test_generate_is_deterministic_and_resumes(smollm2, tmp_path):
  kw = dict(sources=SOURCES, seed=0, max_new_tokens=4, max_prompt_tokens=160, batch_size=2,
            sample_fraction=0.5, valid_fraction=0.3)
  a = distill_data.generate_dataset(smollm2, str(tmp_path / "a.jsonl"), num_examples=4, **kw)
  # the same run in two pieces: 2 examples, then resumed to 4
  distill_data.generate_dataset(smollm2, str(tmp_path / "b.jsonl"), num_examples=2, **kw)
  b = distill_data.generate_dataset(smollm2, str(tmp_path / "b.jsonl"), num_examples=4, **kw)
  key = lambda r: r["id"]  # pylint: disable=unnecessary-lambda-assignment
  assert sorted(a, key=key) == sorted(b, key=key)
  assert len(a) == 4 and {r["id"].split("/")[0] for r in a} == set(SOURCES)
  for r in a:
    assert 1 <= len(r["answer"]) <= 4
    assert r["split"] == distill_data.split_of(r["id"], 0.3)
    assert r["sampling"]["temperature"] in (0.0, 0.7)
  # a run killed mid-write leaves a partial last line: dropped (and cut from
  # the file), so a resume regenerates that example and appends after whole lines
  whole = (tmp_path / "b.jsonl").read_text()
  with open(tmp_path / "b.jsonl", "a") as f:
    f.write('{"id": "alpaca/1", "pro')
  assert distill_data.read_records(str(tmp_path / "b.jsonl")) == b
  assert (tmp_path / "b.jsonl").read_text() == whole
  # ... but a malformed line before the last is damage: a clear error
  (tmp_path / "b.jsonl").write_text('{"id": "alpaca/1", "pro\n' + whole)
  try:
    distill_data.read_records(str(tmp_path / "b.jsonl"))
  except ValueError as e:
    assert "b.jsonl:1: malformed record" in str(e)
  else:
    raise AssertionError("a truncated record was accepted")
  # resuming a file another model wrote is refused before any work, the file kept
  (tmp_path / "b.jsonl").write_text(whole)
  with pytest.raises(ConfigValueError, match=r"model\(s\) smollm2-135m, not 'other-model'"):
    distill_data.generate_dataset(smollm2, str(tmp_path / "b.jsonl"), num_examples=6,
                                  model_name="other-model", **kw)
  assert (tmp_path / "b.jsonl").read_text() == whole
  # ... while the same model named by its GGUF path is the same model
  assert distill_data.generate_dataset(smollm2, str(tmp_path / "b.jsonl"), num_examples=4,
                                       model_name=smollm2.source, **kw) == b


GOOD = {"id": "alpaca/1", "split": "train", "prompt": [1, 2], "answer": [3, 2]}


@pytest.mark.parametrize("field, value, match", [
    ("batch_size", 0, "batch_size must be a whole number >= 1"),
    ("seed", -1, "seed must be a whole number >= 0"),
    ("max_new_tokens", 0, "max_new_tokens must be a whole number >= 1"),
    ("sample_fraction", 1.5, r"sample_fraction must be a finite number in \[0, 1\]"),
    ("valid_fraction", 1.0, r"valid_fraction must be a finite number in \[0, 1\)")])
def test_generation_settings_out_of_range_are_refused_before_the_file(tmp_path, field, value,
                                                                     match):
  path = tmp_path / "d.jsonl"
  with pytest.raises(ConfigValueError, match=match):  # no model is needed to refuse them
    distill_data.generate_dataset(None, str(path), sources=SOURCES, num_examples=2,
                                  **{field: value})
  assert not path.exists()


@pytest.mark.parametrize("bad, match", [
    ({k: v for k, v in GOOD.items() if k != "answer"}, "'answer' must be a list of token ids"),
    ([1, 2, 3], "expected a JSON object, got list"),
    (dict(GOOD, prompt="hello"), "'prompt' must be a list of token ids"),
    (dict(GOOD, prompt=[]), "'prompt' must be a list of token ids"),
    (dict(GOOD, split="Train"), "'split' must be 'train' or 'valid', got 'Train'"),
    (dict(GOOD, answer=[3.5, "x"]), "'answer' must be a list of token ids"),
    (dict(GOOD, answer=[3, -1]), "'answer' must be a list of token ids"),
    (dict(GOOD, id=7), "'id' must be a string, got 7"),
])
def test_a_record_without_the_fields_training_reads_is_refused(tmp_path, bad, match):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
  with pytest.raises(MalformedFileError, match="d.jsonl: record 2.*" + re.escape(match)):
    distill_data.read_records(str(path))
  path.write_text(json.dumps(GOOD) + "\n" + json.dumps(dict(GOOD, id="alpaca/2", answer=[])) + "\n")
  assert len(distill_data.read_records(str(path))) == 2  # an empty answer is allowed


def test_reference_answers(smollm2):
  tok = smollm2.tokenizer
  recs = distill_data.reference_records(tok, sources=SOURCES, num_examples=6,
                                        max_answer_tokens=32, skip_ids=["alpaca/0"])
  assert len(recs) >= 4
  for r in recs:
    assert r["id"].startswith("ref:") and r["origin"] == "reference"
    assert r["answer"][-1] == tok.eos_id and len(r["answer"]) <= 32
    assert r["split"] == distill_data.split_of(r["id"][4:], 0.05)
    json.dumps(r)
  assert "ref:alpaca/0" not in {r["id"] for r in recs}
  # the answer is the dataset's own reference answer (truncated)
  for r in recs:
    name, i = r["id"][4:].split("/")
    rel, _ = distill_data.SOURCES[name]
    path = f"{distill_data.DATA_DIR}/{rel}"
    data = (distill_data._load_jsonl(path) if path.endswith(".jsonl")  # pylint: disable=protected-access
            else distill_data._load_json_array(path))  # pylint: disable=protected-access
    reference = distill_data.REFERENCE_FIELD[name](data[int(i)]).strip()
    text = tok.decode(r["answer"][:-1]).strip()
    assert reference.startswith(text[:60]), (text[:60], reference[:60])


def test_select_holds_out_a_stratified_set_and_nests_training_prefixes():
  recs = [{"id": f"{src}/{i}", "split": distill_data.split_of(f"{src}/{i}", 0.05),
           "prompt": [1, 2], "answer": [3] * (5 + i % 7)}
          for i in range(40) for src in ("alpaca", "code_alpaca", "gsm8k_train")]
  train, valid = distill_data.select(recs, valid_sequences=12)
  assert len(valid) == 12 and len(train) == len(recs) - 12
  assert {r["id"].split("/")[0] for r in valid} == {"alpaca", "code_alpaca", "gsm8k_train"}
  assert all(sum(r["id"].startswith(s) for r in valid) == 4
             for s in ("alpaca", "code_alpaca", "gsm8k_train"))
  assert not {r["id"] for r in valid} & {r["id"] for r in train}
  # nested prefixes with the same validation set
  small, v1 = distill_data.select(recs, valid_sequences=12, train_positions=50)
  big, v2 = distill_data.select(recs, valid_sequences=12, train_positions=300)
  assert v1 == v2 == valid and big[:len(small)] == small
  assert sum(len(r["answer"]) for r in small) >= 50 > sum(len(r["answer"]) for r in small[:-1])
  with pytest.raises(ValueError, match="only"):
    distill_data.select(recs, train_positions=10 ** 6)
  # the hash split without valid_sequences
  t, v = distill_data.select(recs)
  assert all(r["split"] == "valid" for r in v) and all(r["split"] == "train" for r in t)
  # a validation set fixed by ids (a scaling run's, kept while the data grows)
  ids = [r["id"] for r in valid]
  t2, v2 = distill_data.select(recs + [dict(recs[0], id="alpaca/999")], valid_ids=ids)
  assert v2 == valid and t2[-1]["id"] == "alpaca/999"
  with pytest.raises(ValueError, match="not in the data"):
    distill_data.select(recs[:5], valid_ids=ids)
  # a data mix: training on some sources only, the validation set untouched
  t3, v3 = distill_data.select(recs, valid_sequences=12, train_sources=["alpaca", "gsm8k_train"],
                               train_positions=50)
  assert v3 == valid and {r["id"].split("/")[0] for r in t3} == {"alpaca", "gsm8k_train"}
  assert sum(len(r["answer"]) for r in t3) >= 50 > sum(len(r["answer"]) for r in t3[:-1])
  with pytest.raises(ValueError, match="'xsum'.*not in the data"):
    distill_data.select(recs, train_sources=["xsum"])
  # negative or fractional counts were read as something else (valid_sequences=-1
  # held out all records but one; train_positions=-5 trained on one record)
  for field, value in (("valid_sequences", -1), ("train_positions", -5),
                       ("train_positions", 2.5), ("valid_sequences", True)):
    with pytest.raises(ValueError, match=f"{field} must be a whole number >= 0.*got {value!r}"):
      distill_data.select(recs, **{field: value})
  # prefixes taken round-robin over the sources: a source appended as a block
  # at the end of the file is in the smallest prefix, and prefixes still nest
  grown = recs + [{"id": f"xsum/{i}", "split": "train", "prompt": [1], "answer": [4] * 9}
                  for i in range(10)]
  assert not {r["id"].split("/")[0] for r in
              distill_data.select(grown, valid_ids=ids, train_positions=100)[0]} & {"xsum"}
  s1, sv = distill_data.select(grown, valid_ids=ids, train_positions=100, train_order="sources")
  s2, _ = distill_data.select(grown, valid_ids=ids, train_positions=400, train_order="sources")
  assert sv == valid and s2[:len(s1)] == s1
  assert [r["id"].split("/")[0] for r in s1[:4]] == ["alpaca", "code_alpaca", "gsm8k_train", "xsum"]
  assert sum(len(r["answer"]) for r in s1) >= 100 > sum(len(r["answer"]) for r in s1[:-1])
  every = distill_data.select(grown, valid_ids=ids, train_order="sources")[0]
  assert len(every) == len(grown) - len(ids)
  assert {r["id"] for r in every} == {r["id"] for r in grown} - set(ids)
  assert [r["id"] for r in every if r["id"].startswith("xsum")] == [f"xsum/{i}" for i in range(10)]
  with pytest.raises(ValueError, match="unknown train_order 'random'"):
    distill_data.select(recs, train_order="random")


def test_reference_answers_join_the_training_records_only(smollm2):
  """TrainSettings.reference_examples: the datasets' reference answers are
  added after the selection, to training only, from train_sources' sources,
  never for an example the data already answers."""
  from specjax.training import run
  from specjax.training.settings import TrainSettings
  tok = smollm2.tokenizer
  mine = [{"id": f"gsm8k_train/{i}", "split": "train", "prompt": [1, 2], "answer": [3, 4],
           "sampling": None, "seed": 0} for i in range(3)]
  train, valid = distill_data.select(mine, valid_ids=["gsm8k_train/2"])
  c = TrainSettings(method="eagle3", reference_examples=5, sources="alpaca,gsm8k_train",
                    train_sources="gsm8k_train")
  out = run.with_references(c, tok, mine, train)
  assert out[:len(train)] == train and len(out) == len(train) + 5
  ref_ids = {r["id"] for r in out[len(train):]}
  assert all(i.startswith("ref:gsm8k_train/") for i in ref_ids)
  assert not ref_ids & {"ref:" + r["id"] for r in mine}  # validation's example too
  assert valid == [mine[2]]


def test_grown_records_follow_the_selection_with_long_references(smollm2):
  """TrainSettings.grow_records: the training records after the
  train_positions prefix, appended in file order; long_reference_examples:
  reference answers of long_sources with prompts longer than
  max_prompt_tokens and at most long_prompt_tokens, never for an example the
  data or the references already hold; other methods refuse both."""
  from specjax.training import run
  from specjax.training.settings import TrainSettings
  mine = [{"id": f"xsum/{i}", "split": "train", "prompt": [1, 2], "answer": [3] * 10,
           "sampling": None, "seed": 0} for i in range(6)]
  c = TrainSettings(method="eagle3", sources="xsum", train_sources="xsum", train_positions=20,
                    grow_records=True, long_reference_examples=4, max_prompt_tokens=192,
                    long_prompt_tokens=700, long_seq_len=768)
  train, _ = distill_data.select(mine, train_positions=20, valid_ids=["xsum/5"])
  assert [r["id"] for r in train] == ["xsum/0", "xsum/1"]
  grown = run._grown_records(c, smollm2, mine, train, ["xsum/5"], lambda s: None)  # pylint: disable=protected-access
  assert [r["id"] for r in grown[:3]] == ["xsum/2", "xsum/3", "xsum/4"]  # not validation's
  long = grown[3:]
  assert len(long) == 4
  for r in long:
    assert r["id"].startswith("ref:xsum/") and r["id"][4:] not in {m["id"] for m in mine}
    assert 192 < len(r["prompt"]) <= 700 and r["answer"][-1] == smollm2.tokenizer.eos_id
  with pytest.raises(ValueError, match="cannot hold"):
    run.long_references(dataclasses.replace(c, long_seq_len=600), smollm2.tokenizer, mine)
  with pytest.raises(ValueError, match="eagle / eagle3 runs, not 'medusa'"):
    run.run(TrainSettings(method="medusa", model="tiny", grow_records=True,
                          workdir="/tmp/specjax_grow_refused"))
