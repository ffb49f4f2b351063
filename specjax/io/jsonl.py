"""Append-only JSONL logs that survive a kill mid-write.

The resumable runs (training metrics, self-distillation data, the benchmark's
per-prompt log) append one JSON object per line and, on restart, skip what the
log already holds. A process killed while appending can leave its last line
cut short; that line carries no finished result, so `read` drops it and (with
`repair`) truncates the file back to the last complete line, so the next
append starts on a fresh line. Anything malformed before the last line is
damage, not a kill: a `MalformedFileError` naming the file and line.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, Type

from specjax.errors import MalformedFileError


def read_object(path: str, error: Type[MalformedFileError] = MalformedFileError) -> dict:
  """The JSON object in the file at `path` (a card, a config); any failure to
  read or parse it, or a value that is not an object, raises `error` naming
  the file."""
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
    raise error(f"{path} is unreadable: {type(e).__name__}: {e}") from e
  if not isinstance(obj, dict):
    raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def read(path: str, *, repair: bool = True) -> List[dict]:
  """The complete records of the log at `path` ([] if it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  # Every complete record ends with "\n": the text after the last one (usually
  # b"") is what a kill mid-append left behind.
  tail = lines.pop()
  records = []
  for n, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    try:
      records.append(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
      raise MalformedFileError(f"{path}:{n}: malformed record ({str(e)[:200]}); only the "
                               "last line may be cut short by a kill") from e
  if tail.strip():
    try:  # a whole record whose newline did not make it: keep it
      records.append(json.loads(tail.decode("utf-8")))
      fixed = data + b"\n"
    except (UnicodeDecodeError, ValueError, RecursionError):
      fixed = data[:len(data) - len(tail)]
    if repair:
      _replace(path, fixed)
  return records


def append(path: str, rows: Iterable[dict]) -> None:
  """Append `rows`, one line each (one write call, flushed on return)."""
  text = "".join(json.dumps(r) + "\n" for r in rows)
  if text:
    with open(path, "a") as f:
      f.write(text)


def write(path: str, rows: Iterable[dict]) -> None:
  """Replace the log with `rows` atomically (a temporary file, then a rename)."""
  _replace(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _replace(path: str, data: bytes) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)
