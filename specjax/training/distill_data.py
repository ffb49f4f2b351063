"""Self-distillation data: the target's own answers to instruction prompts.

Drafters are trained to predict what the *target* says, not what a dataset's
reference answer says (Medusa and EAGLE both found self-distilled data to
matter). This module turns instruction files from the project's data folder
into chat prompts, generates the target's answers on device with continuous
batching (greedy, and a sampled fraction), and appends them to a JSONL file:

  {"id": "alpaca/17", "split": "train" | "valid", "prompt": [ids...],
   "answer": [ids...], "sampling": {"temperature": .., "top_k": .., "top_p": ..},
   "seed": 0, "model": "smollm2-135m", "max_new_tokens": 192}

Deterministic given the seed: the prompt order, the split (a hash of the id),
which examples are sampled, and every sampled token (per-request keys
fold_in(seed, example number)). A run appends as it goes and a restart skips
the ids already written. Target *features* are not stored: the trainer
recomputes them from the token ids (a 30-layer forward per batch), which keeps
the data a few MB instead of GBs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from specjax import sampling as sampling_lib
from specjax.checks import require_real, require_whole
from specjax.decoding import continuous
from specjax.errors import BadInputError, ConfigValueError, MalformedFileError
from specjax.io import gguf as gguf_io
from specjax.io import jsonl
from specjax.training import decontaminate as decontaminate_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.normpath(os.path.join(_REPO, os.pardir, "shared", "data"))


def _instruction_text(rec: dict) -> str:
  inp = (rec.get("input") or "").strip()
  return rec["instruction"].strip() + ("\n\n" + inp if inp else "")


def _load_json_array(path):
  with open(path) as f:
    return json.load(f)


def _load_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _summarize_text(rec: dict) -> str:
  return "Summarize the following article in one sentence.\n\n" + rec["document"].strip()


# name -> (relative path, record -> user message). Training sources only: the
# evaluation files (spec_bench/*, gsm8k/test.jsonl, whose questions are
# Spec-Bench's math questions word for word) are never read as training data,
# and every source is decontaminated against them (`decontaminate`).
SOURCES: Dict[str, Tuple[str, Callable[[dict], str]]] = {
    "alpaca": ("alpaca/alpaca_5000.json", _instruction_text),
    "code_alpaca": ("code_instructions/code_alpaca_2k.json", _instruction_text),
    "gpteacher_code": ("code_instructions/gpteacher_codegen-instruct.json", _instruction_text),
    "gsm8k_train": ("gsm8k/train.jsonl", lambda r: r["question"].strip()),
    "xsum": ("xsum/xsum_1000.jsonl", _summarize_text),
}


def load_instructions(sources: Sequence[str], data_dir: str = DATA_DIR, *,
                      decontaminate: bool = True) -> List[Tuple[str, str]]:
  """[(id, user message)] for the named sources, in file order; with
  `decontaminate`, without the examples that share a 13-gram with an
  evaluation prompt (`specjax.training.decontaminate`)."""
  out = []
  for name in sources:
    path, text_of = decontaminate_lib.resolve_source(SOURCES, name, data_dir, "data")
    recs = _load_jsonl(path) if path.endswith(".jsonl") else _load_json_array(path)
    out += [(f"{name}/{i}", text_of(r)) for i, r in enumerate(recs)]
  if decontaminate:
    out, _ = decontaminate_lib.decontaminate(out, _eval_index(data_dir))
  return out


_INDEXES: Dict[str, decontaminate_lib.EvalIndex] = {}


def _eval_index(data_dir: str) -> decontaminate_lib.EvalIndex:
  if data_dir not in _INDEXES:
    _INDEXES[data_dir] = decontaminate_lib.eval_index(data_dir)
  return _INDEXES[data_dir]


def split_of(example_id: str, valid_fraction: float) -> str:
  """Deterministic train/valid split from a hash of the id."""
  h = int(hashlib.sha1(example_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
  return "valid" if h < valid_fraction else "train"


def interleave(sources: Sequence[str], examples: Sequence[Tuple[str, str]], num: int,
               seed: int) -> List[Tuple[str, str]]:
  """`num` examples drawn round-robin from the sources, each source shuffled
  by `seed` (so every source is represented however small `num` is)."""
  by_src = {s: [e for e in examples if source_of(e[0]) == s] for s in sources}
  rng = random.Random(seed)
  for v in by_src.values():
    rng.shuffle(v)
  return _turns([by_src[s] for s in sources])[:num]


def _turns(queues: Sequence[Sequence]) -> list:
  """One item of each queue in turn (a queue that runs out drops out)."""
  out: list = []
  for i in range(max((len(q) for q in queues), default=0)):
    out.extend(q[i] for q in queues if i < len(q))
  return out


def read_records(path: str) -> List[dict]:
  """The data set's whole records. A run killed mid-write leaves a cut-short
  last line: it is dropped (and cut from the file), and the resumed run
  generates that example again; a malformed line before it, or a record
  without the fields training reads, is an error (MalformedFileError)."""
  records = jsonl.read(path)
  for n, r in enumerate(records, 1):
    check_record(r, f"{path}: record {n}")
  return records


def _same_model(a: str, b: str) -> bool:
  """Two model names or GGUF paths of one file ('smollm2-135m' and its path)."""
  if a == b:
    return True
  try:
    return os.path.realpath(gguf_io.resolve_model_path(a)) == os.path.realpath(
        gguf_io.resolve_model_path(b))
  except (BadInputError, OSError):
    return False


def check_record(r, where: str) -> None:
  """MalformedFileError (naming `where` and the field) unless `r` is a record
  of the module docstring's form: a str id, split train / valid, a non-empty
  prompt and an answer of non-negative integer token ids."""
  if not isinstance(r, dict):
    raise MalformedFileError(f"{where}: expected a JSON object, got {type(r).__name__}")
  if not isinstance(r.get("id"), str):
    raise MalformedFileError(f"{where}: 'id' must be a string, got {r.get('id')!r}")
  if r.get("split") not in ("train", "valid"):
    raise MalformedFileError(f"{where} ({r['id']}): 'split' must be 'train' or 'valid', got "
                             f"{r.get('split')!r}")
  for field, least in (("prompt", 1), ("answer", 0)):
    ids = r.get(field)
    if not (isinstance(ids, list) and len(ids) >= least and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
      raise MalformedFileError(f"{where} ({r['id']}): {field!r} must be a list of token ids "
                               f"(non-negative integers{', at least one' if least else ''})")


def check_generation(*, num_examples: int, seed: int = 0, max_new_tokens: int = 192,
                     max_prompt_tokens: int = 256, batch_size: int = 8,
                     sample_fraction: float = 0.25, temperature: float = 0.7,
                     top_p: float = 0.9, valid_fraction: float = 0.05, chunk_steps: int = 16,
                     block_examples: int = 1024) -> sampling_lib.SamplingConfig:
  """`generate_dataset`'s settings checked without a model or a file
  (ConfigValueError naming the first one out of range) -> the sampled
  answers' SamplingConfig."""
  for name, value, low in (("num_examples", num_examples, 0), ("seed", seed, 0),
                           ("max_new_tokens", max_new_tokens, 1),
                           ("max_prompt_tokens", max_prompt_tokens, 1),
                           ("batch_size", batch_size, 1), ("chunk_steps", chunk_steps, 1),
                           ("block_examples", block_examples, 1)):
    require_whole(name, value, low)
  require_real("sample_fraction", sample_fraction, 0.0, 1.0)
  require_real("valid_fraction", valid_fraction, 0.0, 1.0, high_open=True)
  return sampling_lib.SamplingConfig(temperature=temperature, top_p=top_p)


def generate_dataset(model, path: str, *, sources: Sequence[str], num_examples: int,
                     seed: int = 0, max_new_tokens: int = 192, max_prompt_tokens: int = 256,
                     batch_size: int = 8, sample_fraction: float = 0.25,
                     temperature: float = 0.7, top_p: float = 0.9, valid_fraction: float = 0.05,
                     data_dir: str = DATA_DIR, model_name: str = "smollm2-135m",
                     chunk_steps: int = 16, block_examples: int = 1024,
                     progress: Optional[Callable[[str], None]] = None) -> List[dict]:
  """Generate (or finish generating) the dataset at `path`; returns its records.

  Examples whose chat prompt exceeds `max_prompt_tokens` are skipped. Example
  n is answered with sampling (temperature / top_p) when a seeded coin says so
  (probability `sample_fraction`), else greedily. Answers are generated with
  continuous batching (`specjax.decoding.continuous.generate_bucketed`:
  `batch_size` rows, a finished row takes the next prompt, one cache size per
  prompt-length bucket), `block_examples` examples at a time in the sources'
  interleaved order, and appended as they finish; example n is request n, so
  its answer does not depend on the batch it shared.
  """
  sampled = check_generation(
      num_examples=num_examples, seed=seed, max_new_tokens=max_new_tokens,
      max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
      sample_fraction=sample_fraction, temperature=temperature, top_p=top_p,
      valid_fraction=valid_fraction, chunk_steps=chunk_steps, block_examples=block_examples)
  progress = progress or (lambda s: None)
  tok = model.tokenizer
  existing = read_records(path)
  others = sorted({r["model"] for r in existing
                   if r.get("model") is not None and not _same_model(r["model"], model_name)})
  if others:  # another model's answers (and token ids) are not this one's to distil
    raise ConfigValueError(f"{path} holds answers of model(s) {', '.join(others)}, not "
                           f"{model_name!r}: write this model's data to another file")
  done = {r["id"] for r in existing}
  chosen = interleave(sources, load_instructions(sources, data_dir), num_examples, seed)
  coin = np.random.default_rng(seed).random(len(chosen))
  greedy = sampling_lib.GREEDY
  todo = []
  for n, (eid, text) in enumerate(chosen):
    if eid in done:
      continue
    prompt = tok.encode_prompt(text)
    if len(prompt) > max_prompt_tokens:
      continue
    todo.append((n, eid, prompt, bool(coin[n] < sample_fraction)))
  total = len(todo)
  made, new_tokens, t0 = 0, 0, time.perf_counter()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  # Blocks of `block_examples` in the sources' interleaved order: a run
  # stopped part way leaves a representative mix of sources and lengths.
  for start in range(0, total, block_examples):
    block = todo[start:start + block_examples]
    for is_sampled in (False, True):
      items = [x for x in block if x[3] == is_sampled]
      if not items:
        continue
      settings = sampled if is_sampled else greedy
      by_n = {n: (eid, prompt) for n, eid, prompt, _ in items}
      answers = continuous.generate_bucketed(
          model.params, model.cfg, ((n, prompt) for n, _, prompt, _ in items), key=seed,
          sampling=settings, batch_size=batch_size, max_new_tokens=max_new_tokens,
          max_prompt_tokens=max_prompt_tokens, chunk_steps=chunk_steps)
      with open(path, "a") as f:
        for n, answer in answers:
          eid, prompt = by_n[n]
          f.write(json.dumps({
              "id": eid, "split": split_of(eid, valid_fraction), "prompt": prompt,
              "answer": [int(t) for t in answer],
              "sampling": {"temperature": settings.temperature, "top_k": settings.top_k,
                           "top_p": settings.top_p},
              "seed": seed, "model": model_name, "max_new_tokens": max_new_tokens}) + "\n")
          f.flush()
          made += 1
          new_tokens += len(answer)
          el = time.perf_counter() - t0
          progress(f"distill data: {made}/{total} answers, {new_tokens} tokens, "
                   f"{new_tokens / el:.1f} tokens/s, {el:.0f}s elapsed, "
                   f"ETA {el / made * (total - made):.0f}s")
  return read_records(path)


# name -> the record's reference answer (the dataset's, not the target's)
REFERENCE_FIELD: Dict[str, Callable[[dict], str]] = {
    "alpaca": lambda r: r["output"],
    "code_alpaca": lambda r: r["output"],
    "gpteacher_code": lambda r: r["response"],
    "gsm8k_train": lambda r: r["answer"],
    "xsum": lambda r: r["summary"],
}


def reference_records(tokenizer, *, sources: Sequence[str], num_examples: int, seed: int = 1,
                      max_prompt_tokens: int = 192, max_answer_tokens: int = 192,
                      valid_fraction: float = 0.05, data_dir: str = DATA_DIR,
                      skip_ids: Iterable[str] = (), min_prompt_tokens: int = 0) -> List[dict]:
  """Records whose answers are the datasets' reference answers (chat prompt,
  answer + EOS, truncated), in the same format as `generate_dataset`'s; the
  prompts kept are longer than `min_prompt_tokens` and at most
  `max_prompt_tokens` tokens (the others are dropped, not cut).

  A feature-level drafter learns the target's distributions at every position
  of any text (the labels come from the target's forward, EAGLE-1 trained on
  fixed data); these cost one forward per sequence instead of a generation,
  so they multiply the training data cheaply. Examples in `skip_ids` (those
  already answered by the target) are left out; ids get a "ref:" prefix.
  """
  examples = []
  for name in sources:
    rel, text_of = SOURCES[name]
    path = os.path.join(data_dir, rel)
    recs = _load_jsonl(path) if path.endswith(".jsonl") else _load_json_array(path)
    examples += [(f"{name}/{i}", text_of(r), REFERENCE_FIELD[name](r)) for i, r in enumerate(recs)]
  # the reference answer is training text too: prompt and answer are checked
  _, dirty = decontaminate_lib.decontaminate([(e[0], e[1] + "\n" + e[2]) for e in examples],
                                             _eval_index(data_dir))
  skip = set(skip_ids) | set(dirty)
  by_id = {e[0]: e for e in examples}
  chosen = interleave(sources, [(e[0], e[1]) for e in examples if e[0] not in skip],
                      num_examples, seed)
  out = []
  for eid, text in chosen:
    prompt = tokenizer.encode_prompt(text)
    if not min_prompt_tokens < len(prompt) <= max_prompt_tokens:
      continue
    answer = tokenizer.encode(by_id[eid][2].strip(), add_bos=False)[:max_answer_tokens - 1]
    out.append({"id": "ref:" + eid, "split": split_of(eid, valid_fraction), "prompt": prompt,
                "answer": answer + [tokenizer.eos_id], "sampling": None, "seed": seed,
                "origin": "reference"})
  return out


def sequences(records: Iterable[dict], split: Optional[str] = None) -> List[Tuple[List[int], int]]:
  """(prompt + answer token ids, prompt length) for the records (of `split`)."""
  return [(r["prompt"] + r["answer"], len(r["prompt"])) for r in records
          if split is None or r["split"] == split]


def source_of(record_id: str) -> str:
  """The source name of a record id ('alpaca/12' -> 'alpaca')."""
  return record_id.split("/")[0]


TRAIN_ORDERS = ("file", "sources")


def round_robin(records: Sequence[dict]) -> List[dict]:
  """The records one per source in turn (sources in sorted name order, each
  in its file order; a source that runs out drops out of the turn)."""
  by_src: Dict[str, List[dict]] = {}
  for r in records:
    by_src.setdefault(source_of(r["id"]), []).append(r)
  return _turns([by_src[s] for s in sorted(by_src)])


def check_selection(*, valid_sequences: int = 0, train_positions: int = 0,
                    train_order: str = "file") -> None:
  """ConfigValueError naming the setting if `select` would refuse these (or,
  for a negative count, silently misread them): callable before the data exists."""
  if train_order not in TRAIN_ORDERS:
    raise ConfigValueError(f"unknown train_order {train_order!r} (known: "
                           f"{', '.join(TRAIN_ORDERS)})")
  require_whole("valid_sequences", valid_sequences, 0, "0: the records' own hash split")
  require_whole("train_positions", train_positions, 0, "0: every training record")


def select(records: Sequence[dict], *, valid_sequences: int = 0, train_positions: int = 0,
           valid_ids: Optional[Sequence[str]] = None,
           train_sources: Optional[Sequence[str]] = None,
           train_order: str = "file") -> Tuple[List[dict], List[dict]]:
  """(train records, validation records).

  valid_sequences = 0: the records' own hash split. N > 0: a fixed held-out
  set of N records stratified by source (round-robin over the sources, each in
  the order of a hash of the ids), the rest for training. train_positions > 0:
  the training records' shortest prefix (in file order, the sources'
  interleaved order) holding that many answer tokens, so smaller sets nest in
  larger ones (a data-scaling curve) and the validation set stays the same.
  valid_ids: the validation records by id (a set chosen before, kept while
  the data grows); every id must be in `records`. train_sources: train only on
  the records of these sources (the validation set is left as it is, so runs
  of different data mixes are measured on the same records); applied before
  the train_positions prefix. train_order: the order the prefix is taken in:
  "file" (the file's, so records appended later come last) or "sources"
  (round-robin over the sources in sorted name order, each in file order, so a
  source whose records sit at the end of the file is in every prefix in its
  share of records; prefixes of one file still nest, and a grown file
  keeps the old order up to where its smallest source first ran out).
  """
  check_selection(valid_sequences=valid_sequences, train_positions=train_positions,
                  train_order=train_order)
  if valid_ids is not None:
    ids = set(valid_ids)
    missing = ids - {r["id"] for r in records}
    if missing:
      raise ValueError(f"{len(missing)} validation ids are not in the data "
                       f"(e.g. {sorted(missing)[0]!r})")
    valid = [r for r in records if r["id"] in ids]
    train = [r for r in records if r["id"] not in ids]
  elif valid_sequences:
    def rank(r):
      return hashlib.sha1(r["id"].encode()).hexdigest()
    chosen = round_robin(sorted(records, key=rank))[:valid_sequences]
    if len(chosen) < valid_sequences or len(chosen) >= len(records):
      raise ValueError(f"valid_sequences={valid_sequences} leaves no training data "
                       f"({len(records)} records)")
    ids = {r["id"] for r in chosen}
    valid = [r for r in records if r["id"] in ids]
    train = [r for r in records if r["id"] not in ids]
  else:
    valid = [r for r in records if r["split"] == "valid"]
    train = [r for r in records if r["split"] == "train"]
  if train_sources:
    known, wanted = {source_of(r["id"]) for r in records}, set(train_sources)
    unknown = sorted(wanted - known)
    if unknown:
      raise ValueError(f"train_sources {unknown} are not in the data "
                       f"(its sources: {', '.join(sorted(known))})")
    train = [r for r in train if source_of(r["id"]) in wanted]
  if train_order == "sources":
    train = round_robin(train)
  if train_positions:
    total, cut = 0, len(train)
    for n, r in enumerate(train):
      total += len(r["answer"])
      if total >= train_positions:
        cut = n + 1
        break
    else:
      raise ValueError(f"train_positions={train_positions}: the data holds only {total} "
                       "training answer tokens")
    train = train[:cut]
  return train, valid
