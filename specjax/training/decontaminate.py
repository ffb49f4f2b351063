"""Decontamination: no training text shares a 13-gram with an evaluation prompt.

A drafter trained on the questions it is later benchmarked on accepts more
than it would on unseen text, and the tables would say so without saying
why. Every training source is therefore filtered against every evaluation
file in the data folder, as GPT-3 and the Llama papers filtered their
pre-training data: text is lower-cased and cut into words (`\\w+`, Unicode
aware), and a training example is dropped when any 13 consecutive words of it
occur in any evaluation prompt or reference answer. Texts shorter than 13
words cannot be checked by 13-grams; they are dropped when their words equal
an evaluation text's words exactly.

What this cannot see: paraphrases, translations of an evaluation text, and
evaluation sets that are not in the data folder (the held-out sets used to
evaluate the project are kept elsewhere on purpose).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Set, Tuple

N = 13
_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> List[str]:
  return _WORD.findall(text.lower())


def _key(ws: Sequence[str]) -> int:
  # Python's tuple hash: salted per process, which is all an in-memory index needs.
  return hash(tuple(ws))


def ngram_keys(text: str, n: int = N) -> Set[int]:
  ws = words(text)
  return {_key(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def _spec_bench_texts(rec: dict) -> Iterator[str]:
  yield from rec.get("turns", [])
  for ref in rec.get("reference") or []:
    if isinstance(ref, str):
      yield ref
    elif isinstance(ref, list):  # rag: lists of answer strings
      yield from (r for r in ref if isinstance(r, str))


def _gsm8k_texts(rec: dict) -> Iterator[str]:
  yield rec["question"]
  yield rec["answer"]


# The evaluation files of the data folder: name -> (relative path, record -> texts).
EVAL_SOURCES = {
    "spec_bench": ("spec_bench/question_excl_mtbench.jsonl", _spec_bench_texts),
    "gsm8k_test": ("gsm8k/test.jsonl", _gsm8k_texts),
}


@dataclasses.dataclass
class EvalIndex:
  """The 13-grams (hashed) and short texts of a set of evaluation files."""

  grams: Set[int]
  short: Set[Tuple[str, ...]]
  sources: Dict[str, int]  # name -> records indexed

  def contaminated(self, text: str) -> bool:
    ws = words(text)
    if len(ws) < N:
      return tuple(ws) in self.short
    return any(_key(ws[i:i + N]) in self.grams for i in range(len(ws) - N + 1))


def resolve_source(table: Dict[str, Tuple[str, Callable]], name: str, data_dir: str,
                   kind: str) -> Tuple[str, Callable]:
  """(the file's path, its record reader) for source `name` of `table`; a
  clear error for an unknown name or a missing file."""
  if name not in table:
    raise ValueError(f"unknown {kind} source {name!r}; available: {', '.join(table)}")
  rel, read = table[name]
  path = os.path.join(data_dir, rel)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{kind} source {name!r}: {path} does not exist")
  return path, read


def eval_index(data_dir: str, sources: Iterable[str] = tuple(EVAL_SOURCES)) -> EvalIndex:
  """The index of the named evaluation files (every one by default)."""
  grams, short, counts = set(), set(), {}
  for name in sources:
    path, texts_of = resolve_source(EVAL_SOURCES, name, data_dir, "evaluation")
    n = 0
    with open(path) as f:
      for line in f:
        if not line.strip():
          continue
        n += 1
        for text in texts_of(json.loads(line)):
          ws = words(text)
          if len(ws) < N:
            short.add(tuple(ws))
          grams.update(_key(ws[i:i + N]) for i in range(len(ws) - N + 1))
    counts[name] = n
  return EvalIndex(grams=grams, short=short, sources=counts)


def decontaminate(examples: Sequence[Tuple[str, str]], index: EvalIndex
                  ) -> Tuple[List[Tuple[str, str]], List[str]]:
  """(id, text) examples -> (the clean ones, the ids dropped)."""
  kept, dropped = [], []
  for eid, text in examples:
    if index.contaminated(text):
      dropped.append(eid)
    else:
      kept.append((eid, text))
  return kept, dropped
