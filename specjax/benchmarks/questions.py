"""Prompt files in the Spec-Bench format (Xia et al. 2024, arXiv:2401.07851): one
JSON record per line with `question_id`, `category` and `turns`; read with
clear errors for malformed files, grouped into batches of one category, and
turned into chat conversations turn by turn."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional, Sequence

from specjax.checks import require_whole
from specjax.errors import PromptFileError

# Request ids (key derivation): question_id * TURN_IDS + turn.
TURN_IDS = 16
# The headline prompt set: Spec-Bench without its MT-Bench part, in the data
# folder next to the repository (../shared/data).
SPEC_BENCH = os.path.normpath(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, "shared",
    "data", "spec_bench", "question_excl_mtbench.jsonl"))


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: int
  category: str
  turns: tuple


def _question(rec, where: str) -> Question:
  """One Spec-Bench record -> Question (PromptFileError naming `where` if malformed)."""
  if not isinstance(rec, dict):
    raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  for field in ("question_id", "category", "turns"):
    if field not in rec:
      raise PromptFileError(f"{where}: record has no {field!r} (Spec-Bench JSONL expected)")
  qid, cat, turns = rec["question_id"], rec["category"], rec["turns"]
  if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < 2 ** 31 // TURN_IDS:
    raise PromptFileError(f"{where}: 'question_id' must be an integer in "
                          f"[0, {2 ** 31 // TURN_IDS}), got {str(qid)[:40]!r}")
  if not isinstance(cat, str) or not cat:
    raise PromptFileError(f"{where}: 'category' must be a non-empty string, got {str(cat)[:40]!r}")
  if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
    raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
  if len(turns) > TURN_IDS:
    raise PromptFileError(f"{where}: {len(turns)} turns, at most {TURN_IDS} supported")
  return Question(qid, cat, tuple(turns))


def load_questions(path: str, prompt_limit: Optional[int] = None) -> List[Question]:
  """Questions in file order; at most `prompt_limit` per category (None/0: all).

  Raises PromptFileError naming the file and line for a missing or unreadable
  file, a line that is not UTF-8 JSON, a record without `question_id` (a
  non-negative integer), `category` (a string) or `turns` (a non-empty list of
  strings), a repeated question_id, or a file without questions.
  """
  if prompt_limit is not None:
    require_whole("prompt_limit", prompt_limit, 0, "questions per category; 0: all")
  out, seen, ids = [], {}, {}
  try:
    f = open(path, "rb")
  except OSError as e:
    raise PromptFileError(f"{path}: cannot read the prompt file: {e}") from e
  with f:
    for n, raw in enumerate(f, 1):
      where = f"{path}:{n}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise PromptFileError(f"{where}: not UTF-8 text ({e})") from e
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except (ValueError, RecursionError) as e:  # JSONDecodeError; absurdly deep nesting
        raise PromptFileError(f"{where}: not a JSON line: {str(e)[:200]}") from e
      q = _question(rec, where)
      if q.question_id in ids:
        raise PromptFileError(f"{where}: question_id {q.question_id} repeats line "
                              f"{ids[q.question_id]}")
      ids[q.question_id] = n
      if prompt_limit and seen.get(q.category, 0) >= prompt_limit:
        continue
      seen[q.category] = seen.get(q.category, 0) + 1
      out.append(q)
  if not out:
    raise PromptFileError(f"{path}: no questions")
  return out


def make_units(questions: Sequence[Question], batch_size: int) -> List[tuple]:
  """Batches of up to `batch_size` consecutive questions of one category."""
  units, cur = [], []
  for q in questions:
    if cur and (len(cur) == batch_size or cur[0].category != q.category):
      units.append(tuple(cur))
      cur = []
    cur.append(q)
  if cur:
    units.append(tuple(cur))
  return units


def unit_id(unit: Sequence[Question]) -> str:
  return "+".join(str(q.question_id) for q in unit)


def chat_messages(turns: Sequence[str], answers: Sequence[str]) -> List[dict]:
  """The conversation up to the last of `turns`: user turn i, then answer i."""
  msgs = []
  for i, turn in enumerate(turns):
    msgs.append({"role": "user", "content": turn})
    if i < len(turns) - 1:
      msgs.append({"role": "assistant", "content": answers[i]})
  return msgs
