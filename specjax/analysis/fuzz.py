"""Fuzzing the parsers: every malformed input is a clear error, never a crash.

Small valid inputs of each kind are written once (`make_seeds`), then mutated:
truncated, bytes flipped, length / count / offset fields overwritten with huge
values, NaN / inf written into weights, JSON fields replaced by values of the
wrong type or range. Each mutant is loaded by the library's own entry point
and must either load and pass a sanity check (finite weights of the declared
shapes, questions of the right types) or raise the library's error for it:

  gguf         specjax.io.load.load_model on a .gguf file      -> MalformedFileError
  safetensors  specjax.io.hf.load_hf, model.safetensors mutated -> MalformedFileError
  hf_config    specjax.io.hf.load_hf, config.json mutated       -> MalformedFileError
  checkpoint   specjax.io.checkpoints.load_drafter        -> MalformedFileError
  prompts      specjax.benchmarks.questions.load_questions     -> MalformedFileError
  config       run settings -> SamplingConfig, SpecConfig and
               specjax.drafters.registry.make_drafter           -> BadInputError

Anything else -- another exception type, a sanity failure, an input that takes
longer than `time_limit_s` -- is a crash. Mutations draw their choices through
a `draw(lo, hi) -> int` callback, so the same mutators serve a seeded random
loop (`run`, behind experiments/fuzz.py) and hypothesis strategies (the test
suite), which can then shrink a failing input.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import struct
import tempfile
import time
import traceback
from typing import Callable, List, Optional

import jax
import numpy as np

from specjax.errors import BadInputError, ConfigValueError, MalformedFileError
from specjax.io import gguf_writer

Draw = Callable[[int, int], int]  # draw(lo, hi): an integer in [lo, hi]

KINDS = ("gguf", "safetensors", "hf_config", "checkpoint", "prompts", "config")

# Values written over length / count / offset fields: boundaries and huge sizes.
BOUNDARY_U64 = (0, 1, 7, 8, 255, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32,
                2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1)
NONFINITE_F32 = (float("nan"), float("inf"), float("-inf"))
# JSON values of every type and range, for replacing fields.
JSON_VALUES = (None, True, False, 0, 1, -1, 2, 3, 7, 64, 2 ** 31, 2 ** 63, 10 ** 30, -(2 ** 40),
               0.0, 0.5, -0.5, 1e-300, 1e300, float("nan"), float("inf"), "", "x", "llama",
               "float32", "bfloat16", "int8", [], [1], [1, 2], ["a"], {}, {"a": 1}, "0" * 300)


def _pick(draw: Draw, seq):
  return seq[draw(0, len(seq) - 1)]


# ----------------------------------------------------------------------------
# Byte-level mutators: (data, draw, fields) -> (mutant, name)
#
# `fields` lists (offset, size) of the scalar fields of the valid seed (lengths,
# counts, types, offsets, dims); `floats` the ranges of float32 weights.


def mutate_bytes(data: bytes, draw: Draw, fields=(), floats=()) -> tuple:
  """One mutation of `data`, chosen by `draw`: -> (mutant bytes, mutation name)."""
  n = len(data)
  ops = ["truncate", "flip", "flips", "splice"]
  ops += ["u64_field", "u32_field"] if fields else ["u64", "u32"]
  ops += ["nan_weight"] if floats else []
  op = _pick(draw, ops)
  buf = bytearray(data)
  if op == "truncate":
    return bytes(buf[:draw(0, max(n - 1, 0))]), op
  if op == "flip":
    i = draw(0, n - 1)
    buf[i] ^= draw(1, 255)
    return bytes(buf), op
  if op == "flips":
    for _ in range(draw(2, 16)):
      buf[draw(0, n - 1)] = draw(0, 255)
    return bytes(buf), op
  if op == "splice":  # delete or duplicate a range: shifts every later offset
    i = draw(0, n - 1)
    j = min(n, i + draw(1, 64))
    if draw(0, 1):
      return bytes(buf[:i] + buf[j:]), "delete"
    return bytes(buf[:j] + buf[i:j] + buf[j:]), "duplicate"
  if op in ("u64_field", "u32_field"):
    off, size = _pick(draw, fields)
    value = _pick(draw, BOUNDARY_U64 + (n, n + 1, 2 * n))
    if size >= 8:
      buf[off:off + 8] = struct.pack("<Q", value % 2 ** 64)
    else:
      buf[off:off + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
    return bytes(buf), op
  if op in ("u64", "u32"):
    size = 8 if op == "u64" else 4
    off = draw(0, max(n - size, 0))
    value = _pick(draw, BOUNDARY_U64) % 2 ** (8 * size)
    buf[off:off + size] = value.to_bytes(size, "little")
    return bytes(buf[:n]), op
  # nan_weight: a NaN / inf float32 inside a float32 tensor's data
  start, stop = _pick(draw, floats)
  off = start + 4 * draw(0, max((stop - start) // 4 - 1, 0))
  buf[off:off + 4] = struct.pack("<f", _pick(draw, NONFINITE_F32))
  return bytes(buf), op


def mutate_json(obj, draw: Draw, keys: Optional[List[str]] = None):
  """A copy of a JSON object with one key set to a value of another type or
  range, deleted, or (nested objects) recursed into: -> (object, name)."""
  obj = json.loads(json.dumps(obj))
  target = obj
  while True:
    if not isinstance(target, dict) or not target:
      return obj, "json_none"
    names = sorted(target) if keys is None or target is not obj else keys
    key = _pick(draw, names)
    op = draw(0, 9)
    if op == 0:
      target.pop(key, None)
      return obj, "json_delete"
    if op == 1 and isinstance(target.get(key), dict):
      target = target[key]
      continue
    target[key] = _pick(draw, JSON_VALUES)
    return obj, "json_value"


# ----------------------------------------------------------------------------
# Seeds: small valid inputs of every kind


def tiny_vocab():
  """A 64-token byte-level BPE vocabulary, its merges and token types."""
  control = ["<unk>", "<|im_start|>", "<|im_end|>"]
  letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", " ", ".", ","]
  merged = ["ab", "Ġa", "th", "the", "Ġthe", "in", "er", "an", "on", "re"]
  tokens = control + letters + merged
  tokens += [f"t{i}" for i in range(64 - len(tokens))]
  merges = ["a b", "Ġ a", "t h", "th e", "Ġ the", "i n", "e r", "a n", "o n", "r e"]
  types = [3] * len(control) + [1] * (len(tokens) - len(control))
  return tokens, merges, types


def write_tiny_gguf(path: str, cfg, params, tokenizer: bool = True) -> str:
  """A llama GGUF of `params` (specjax layout) with a tiny tokenizer; mixed
  tensor types (F32 norms, Q8_0 / F16 / Q4_1 matrices)."""
  qtypes = {"token_embd.weight": "Q8_0"}
  for i in range(cfg.num_layers):
    qtypes.update({f"blk.{i}.attn_k.weight": "F16", f"blk.{i}.attn_v.weight": "Q8_0",
                   f"blk.{i}.ffn_gate.weight": "Q4_1", f"blk.{i}.ffn_up.weight": "F16"})
  tok = None
  if tokenizer:
    tokens, merges, types = tiny_vocab()
    tok = gguf_writer.TokenizerFields(
        tokens=tokens, token_types=types, merges=merges,
        chat_template="{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                      "{% endfor %}")
  return gguf_writer.write_llama_gguf(path, cfg, params, tokenizer=tok, qtypes=qtypes)


def gguf_fields(path: str) -> tuple:
  """(scalar field ranges, float32 tensor data ranges) of a valid GGUF file,
  found through the reader's views into its memory map."""
  from specjax.io import gguf as gguf_io  # pylint: disable=import-outside-toplevel

  reader = gguf_io.open_gguf(path)
  base = reader.data.ctypes.data
  fields = [(0, 4), (4, 4), (8, 8), (16, 8)]
  for fld in list(reader.fields.values()) + [t.field for t in reader.tensors]:
    for part in fld.parts[:64]:
      if 0 < part.nbytes <= 8:
        fields.append((part.ctypes.data - base, part.nbytes))
  floats = [(t.data_offset, t.data_offset + t.n_bytes) for t in reader.tensors
            if t.tensor_type.name == "F32"]
  return sorted(set(fields)), floats


def safetensors_fields(path: str) -> tuple:
  """(the header-length field, float32 tensor data ranges) of a safetensors file."""
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
  floats = [(8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1])
            for k, t in header.items() if k != "__metadata__" and t["dtype"] == "F32"]
  return [(0, 8)], floats


def mutate_safetensors_header(data: bytes, draw: Draw) -> tuple:
  """The header JSON with one tensor's dtype, shape or offsets changed (wrong
  type, huge, negative, swapped), the data kept: -> (bytes, name)."""
  n = struct.unpack("<Q", data[:8])[0]
  header = json.loads(data[8:8 + n])
  name = _pick(draw, sorted(k for k in header if k != "__metadata__"))
  entry = header[name]
  field = _pick(draw, ["dtype", "shape", "data_offsets"])
  if field == "dtype":
    entry["dtype"] = _pick(draw, ["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL",
                                  "F8_E4M3", "F8_E5M2", "XX", 7])
  elif field == "shape":
    shape = list(entry["shape"])
    choice = draw(0, 4)
    if choice == 0:
      shape = shape[::-1]
    elif choice == 1:
      shape.append(draw(0, 3))
    elif choice == 2 and shape:
      shape[draw(0, len(shape) - 1)] = _pick(draw, [0, 2 ** 31, 2 ** 62, 2 ** 64 - 1])
    elif choice == 3:
      shape = shape[1:]
    else:
      shape = [_pick(draw, JSON_VALUES[:12])]
    entry["shape"] = shape
  else:
    lo, hi = entry["data_offsets"]
    choice = draw(0, 3)
    entry["data_offsets"] = ([hi, lo], [lo, hi + _pick(draw, [1, 4, 2 ** 40, 2 ** 63])],
                             [lo + 4, hi], [lo, _pick(draw, JSON_VALUES)])[choice]
  head = json.dumps(header).encode()
  head += b" " * (-len(head) % 8)
  return struct.pack("<Q", len(head)) + head + data[8 + n:], f"header_{field}"


PROMPTS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 2, "category": "copy", "turns": ["Name a color.", "Name another one."]},
    {"question_id": 3, "category": "qa", "turns": ["Count from one to five."]},
]


def mutate_prompts(data: bytes, draw: Draw) -> tuple:
  """A JSONL prompt file with one record's field replaced / deleted, a line
  of garbage or invalid UTF-8 inserted, or a byte-level mutation."""
  lines = data.split(b"\n")
  op = draw(0, 3)
  if op == 0:
    i = draw(0, len(PROMPTS) - 1)
    rec, name = mutate_json(PROMPTS[i], draw, keys=["question_id", "category", "turns"])
    lines[i] = json.dumps(rec, allow_nan=True).encode()
    return b"\n".join(lines), name
  if op == 1:
    garbage = _pick(draw, [b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe\x00", b"{\"a\":",
                           b"[" * 100000, b"{}", b"42", b'{"question_id": 1e400}'])
    lines.insert(draw(0, len(lines)), garbage)
    return b"\n".join(lines), "insert_line"
  if op == 2:
    return b"", "empty"
  return mutate_bytes(data, draw)


@dataclasses.dataclass
class Seeds:
  """Valid inputs of every kind in `workdir` and what mutating them needs."""

  workdir: str
  cfg: object  # the tiny ModelConfig of the GGUF / HF seeds
  gguf: str
  gguf_fields: list
  gguf_floats: list
  hf_dir: str
  st_fields: list
  st_floats: list
  checkpoint: str
  checkpoint_nan: str
  prompts: str
  target: object  # a specjax.io.load.Model for the config fuzzer

  def scratch(self, name: str) -> str:
    return os.path.join(self.workdir, "mutants", name)


def tiny_drafter_params():
  rng = np.random.default_rng(0)
  return {"w": rng.standard_normal((2, 16, 16)).astype(np.float32),
          "norm": np.ones((16,), np.float32), "layers": [
              {"a": rng.standard_normal((4, 4)).astype(np.float32)}]}


def make_seeds(workdir: str) -> Seeds:
  """Write one valid input of every kind under `workdir`."""
  from specjax.io import hf  # pylint: disable=import-outside-toplevel
  from specjax.io.load import Model  # pylint: disable=import-outside-toplevel
  from specjax.models import transformer  # pylint: disable=import-outside-toplevel
  from specjax.models.config import tiny_config  # pylint: disable=import-outside-toplevel
  from specjax.io import checkpoints  # pylint: disable=import-outside-toplevel

  os.makedirs(os.path.join(workdir, "mutants"), exist_ok=True)
  cfg = tiny_config(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    head_dim=8, ffn_dim=64, max_seq_len=128, bos_id=1, eos_id=2, pad_id=2)
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(0), cfg))
  gguf_path = write_tiny_gguf(os.path.join(workdir, "tiny.gguf"), cfg, params)
  g_fields, g_floats = gguf_fields(gguf_path)
  hf_dir = os.path.join(workdir, "hf")
  hf.save_hf(hf_dir, params, cfg)
  st_fields, st_floats = safetensors_fields(os.path.join(hf_dir, hf.WEIGHTS_FILE))
  card = {"method": "medusa", "target_fingerprint": "0123456789abcdef", "num_layers": 1}
  ckpt = os.path.join(workdir, "ckpt")
  checkpoints.save_drafter(ckpt, tiny_drafter_params(), card)
  bad = tiny_drafter_params()
  bad["layers"][0]["a"][1, 2] = np.nan
  ckpt_nan = os.path.join(workdir, "ckpt_nan")
  checkpoints.save_drafter(ckpt_nan, bad, card)
  prompts = os.path.join(workdir, "prompts.jsonl")
  with open(prompts, "w", encoding="utf-8") as f:
    f.write("".join(json.dumps(p) + "\n" for p in PROMPTS))
  target = Model(jax.tree.map(np.asarray, params), cfg, None, "tiny")
  return Seeds(workdir, cfg, gguf_path, g_fields, g_floats, hf_dir, st_fields, st_floats, ckpt,
               ckpt_nan, prompts, target)


# ----------------------------------------------------------------------------
# Loading a mutant, with a sanity check of what loaded


class InsaneResult(AssertionError):
  """A mutant loaded without error but what came out is not sane."""


def _check_finite_params(params, where: str) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise InsaneResult(f"{where}: no parameters")
  for path, leaf in leaves:
    arr = np.asarray(leaf)
    if arr.dtype.kind in "fV" or arr.dtype.name == "bfloat16":
      if not np.isfinite(arr.astype(np.float32)).all():
        raise InsaneResult(f"{where}: {jax.tree_util.keystr(path)} has NaN / inf")


def _check_model(params, cfg, where: str) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  _check_finite_params(params, where)
  want = dict(hf.expected_shapes(cfg))
  got = {name: tuple(w.shape) for name, w in hf.to_hf_tensors(params, cfg)}
  if got != want:
    raise InsaneResult(f"{where}: loaded shapes {got} do not match the config {want}")


def _write(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)


def fuzz_gguf(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io.load import load_model  # pylint: disable=import-outside-toplevel

  with open(seeds.gguf, "rb") as f:
    data = f.read()
  mutant, name = mutate_bytes(data, draw, seeds.gguf_fields, seeds.gguf_floats)
  path = seeds.scratch("m.gguf")
  _write(path, mutant)
  note(name)
  model = load_model(path)
  _check_model(model.params, model.cfg, path)
  model.tokenizer.decode(model.tokenizer.encode("the cat"))


def _hf_mutant_dir(seeds: Seeds) -> str:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = seeds.scratch("hf")
  os.makedirs(out, exist_ok=True)
  for name in (hf.CONFIG_FILE, hf.WEIGHTS_FILE):
    shutil.copyfile(os.path.join(seeds.hf_dir, name), os.path.join(out, name))
  return out


def fuzz_safetensors(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = _hf_mutant_dir(seeds)
  file = os.path.join(out, hf.WEIGHTS_FILE)
  with open(file, "rb") as f:
    data = f.read()
  if draw(0, 2) == 0:
    mutant, name = mutate_safetensors_header(data, draw)
  else:
    mutant, name = mutate_bytes(data, draw, seeds.st_fields, seeds.st_floats)
  _write(file, mutant)
  note(name)
  params, cfg = hf.load_hf(out)
  _check_model(params, cfg, out)


def fuzz_hf_config(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = _hf_mutant_dir(seeds)
  file = os.path.join(out, hf.CONFIG_FILE)
  with open(file, "rb") as f:
    data = f.read()
  if draw(0, 3):
    obj, name = mutate_json(json.loads(data), draw)
    mutant = json.dumps(obj).encode()
  else:
    mutant, name = mutate_bytes(data, draw)
  _write(file, mutant)
  note(name)
  params, cfg = hf.load_hf(out)
  _check_model(params, cfg, out)


def fuzz_checkpoint(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import checkpoints  # pylint: disable=import-outside-toplevel

  out = seeds.scratch("ckpt")
  shutil.rmtree(out, ignore_errors=True)
  source = seeds.checkpoint_nan if draw(0, 7) == 0 else seeds.checkpoint
  shutil.copytree(source, out)
  files = sorted(os.path.relpath(os.path.join(d, f), out)
                 for d, _, fs in os.walk(out) for f in fs)
  op = draw(0, 5)
  if source == seeds.checkpoint_nan:
    name = "nan_weight"
  elif op == 0:
    victim = _pick(draw, files)
    os.remove(os.path.join(out, victim))
    name = "delete_file"
  elif op == 1:
    with open(os.path.join(out, checkpoints.CARD), encoding="utf-8") as f:
      card, name = mutate_json(json.load(f), draw)
    with open(os.path.join(out, checkpoints.CARD), "w", encoding="utf-8") as f:
      json.dump(card, f)
  else:
    victim = os.path.join(out, _pick(draw, files))
    with open(victim, "rb") as f:
      data = f.read()
    if not data:
      data = b"\x00"
    mutant, name = mutate_bytes(data, draw)
    _write(victim, mutant)
  note(name)
  params, card = checkpoints.load_drafter(out, method=None)
  if not isinstance(card, dict):
    raise InsaneResult(f"{out}: card is a {type(card).__name__}")
  _check_finite_params(params, out)


def fuzz_prompts(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.benchmarks import questions as questions_lib  # pylint: disable=import-outside-toplevel

  with open(seeds.prompts, "rb") as f:
    data = f.read()
  mutant, name = mutate_prompts(data, draw)
  path = seeds.scratch("prompts.jsonl")
  _write(path, mutant)
  note(name)
  questions = questions_lib.load_questions(path)
  for q in questions:
    if not (isinstance(q.question_id, int) and isinstance(q.category, str) and q.turns
            and all(isinstance(t, str) for t in q.turns)):
      raise InsaneResult(f"{path}: loaded an ill-typed question {q}")


# Run settings of configs/*.py as make_drafter reads them, and values to try.
CONFIG_FIELDS = {
    "method": ["prompt_lookup", "layer_skip", "draft_model", "replay", "always_reject",
               "lookahead", "lookahead_tree", "medusa", "eagle_tree", "no_such_method",
               "prompt_lookup@k=2", "prompt_lookup@k=-1", "layer_skip@layers=9",
               "prompt_lookup@bogus=1", "prompt_lookup@", "@", "lookahead@window=0"],
    "k": [1, 2, 4, 0, -1, -5, 2.5, "3", None, True, 10 ** 9],
    "temperature": [0.0, 0.7, 1.0, -0.1, -1, float("nan"), float("inf"), "hot", None],
    "top_k": [0, 5, -1, 2.5, "x", None, 10 ** 12],
    "top_p": [1.0, 0.9, 0.0, -0.5, 1.5, float("nan"), "x", None],
    "max_ngram": [3, 1, 0, -2, "x", None],
    "min_ngram": [1, 0, 5, -1, None],
    "layers": ["0", "0-0", "every2", "", "5", "-1", "0-9", "a-b", None, 3],
    "draft_model": ["self:1", "self:0", "self:99", "self:x", "/no/such/dir", None],
    "checkpoint": ["/no/such/checkpoint", None],
    "draft_stop": [0.0, 0.5, -1.0, 2.0, float("nan"), "x", None],
    "tree_nodes": [16, 1, 0, -3, "x", None, [1]],
    "tree_mode": ["wor", "iid", "topk", "bogus", None, 1],
    "tree_topk": [4, 1, 0, -1, None],
    "tree_width": [4, 1, 0, 9, None],
    "window": [4, 0, -1, None],
    "ngram": [3, 1, 0, None],
    "max_candidates": [4, 0, None],
}


def fuzz_config(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax import sampling as sampling_lib  # pylint: disable=import-outside-toplevel
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel

  config = {name: _pick(draw, values) for name, values in CONFIG_FIELDS.items()
            if draw(0, 2)}
  config.setdefault("method", "prompt_lookup")
  note("settings")
  sampling = registry.sampling_of(config)
  spec = sp.SpecConfig(sampling=sampling)
  drafter, draft_params = registry.make_drafter(
      config["method"], config, seeds.target, sampling=sampling, reference=[[5, 6, 7]])
  drafter.check(seeds.target.cfg, draft_params)
  if not isinstance(spec.sampling, sampling_lib.SamplingConfig) or drafter.k < 1:
    raise InsaneResult(f"config {config} built k={drafter.k}")


FUZZERS = {"gguf": fuzz_gguf, "safetensors": fuzz_safetensors, "hf_config": fuzz_hf_config,
           "checkpoint": fuzz_checkpoint, "prompts": fuzz_prompts, "config": fuzz_config}
# The error every input of a kind must raise if it does not load.
EXPECTED_ERROR = {kind: MalformedFileError for kind in KINDS}
EXPECTED_ERROR["config"] = BadInputError


def try_one(kind: str, seeds: Seeds, draw: Draw) -> tuple:
  """Mutate and load one input -> (outcome, mutation, detail). outcome is
  'loaded', 'rejected' (the expected error) or 'crash' (anything else)."""
  seen = ["?"]
  try:
    FUZZERS[kind](seeds, draw, lambda name: seen.__setitem__(0, name))
    return "loaded", seen[0], ""
  except EXPECTED_ERROR[kind] as e:
    return "rejected", seen[0], str(e)[:300]
  except Exception as e:  # pylint: disable=broad-except
    return "crash", seen[0], "".join(traceback.format_exception(type(e), e, e.__traceback__))


# ----------------------------------------------------------------------------
# The timed random loop


class _Timeout(BaseException):
  """One input ran past its time limit (a BaseException: not caught as a crash)."""


@contextlib.contextmanager
def _time_limit(seconds: float):
  def handler(signum, frame):
    raise _Timeout()

  old = signal.signal(signal.SIGALRM, handler)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def run(seconds: float, seed: int = 0, kinds=KINDS, workdir: Optional[str] = None,
        time_limit_s: float = 30.0, log: Optional[Callable[[str], None]] = None) -> dict:
  """Fuzz the parsers round-robin over `kinds` for `seconds` -> report.

  report: per kind, inputs tried, how many loaded, were rejected with the
  expected error, crashed (another exception, a sanity failure, or past
  `time_limit_s`), by mutation; the first crashes with tracebacks; seconds,
  the slowest input, and the peak RSS growth (an unbounded allocation shows
  there).
  """
  unknown = sorted(set(kinds) - set(KINDS))
  if unknown or not kinds:
    raise ConfigValueError(f"fuzz kinds {unknown or '(none)'}: expected some of {list(KINDS)}")
  rng = np.random.default_rng(seed)

  def draw(lo, hi):
    return int(rng.integers(lo, hi + 1))

  own = workdir is None
  workdir = workdir or tempfile.mkdtemp(prefix="specjax-fuzz-")
  try:
    t0 = time.perf_counter()
    seeds = make_seeds(workdir)
    setup_s = time.perf_counter() - t0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts = {k: collections.Counter() for k in kinds}
    by_mutation = {k: collections.Counter() for k in kinds}
    crashes, slowest = [], (0.0, "", "")
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
      kind = kinds[i % len(kinds)]
      i += 1
      start = time.perf_counter()
      try:
        with _time_limit(time_limit_s):
          outcome, name, detail = try_one(kind, seeds, draw)
      except _Timeout:
        outcome, name, detail = "crash", "?", f"took longer than {time_limit_s} s (hang?)"
      took = time.perf_counter() - start
      if took > slowest[0]:
        slowest = (took, kind, name)
      counts[kind][outcome] += 1
      counts[kind]["tried"] += 1
      by_mutation[kind][f"{name}:{outcome}"] += 1
      if outcome == "crash":
        crashes.append({"kind": kind, "mutation": name, "detail": detail})
        if log:
          log(f"CRASH {kind} {name}: {detail}")
      if log and i % 1000 == 0:
        log(f"{i} inputs, {time.perf_counter() - t0:.0f} s")
    elapsed = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": elapsed,
        "setup_seconds": setup_s,
        "inputs": sum(c["tried"] for c in counts.values()),
        "crashes": sum(c["crash"] for c in counts.values()),
        "kinds": {k: {o: counts[k][o] for o in ("tried", "loaded", "rejected", "crash")}
                  for k in kinds},
        "mutations": {k: dict(sorted(by_mutation[k].items())) for k in kinds},
        "slowest_input_s": slowest[0],
        "slowest_input": f"{slowest[1]} {slowest[2]}",
        "peak_rss_growth_mb": (rss1 - rss0) / 1024.0,
        "crash_examples": crashes[:10],
        "seed": seed,
    }
  finally:
    if own:
      shutil.rmtree(workdir, ignore_errors=True)


def format_report(report: dict) -> str:
  lines = [f"fuzzed {report['inputs']} inputs in {report['seconds']:.0f} s "
           f"(setup {report['setup_seconds']:.1f} s), seed {report['seed']}: "
           f"{report['crashes']} crashes",
           f"{'kind':12s} {'tried':>7s} {'loaded':>7s} {'rejected':>9s} {'crash':>6s}"]
  for kind, c in report["kinds"].items():
    lines.append(f"{kind:12s} {c['tried']:7d} {c['loaded']:7d} {c['rejected']:9d} "
                 f"{c['crash']:6d}")
  lines.append(f"slowest input {report['slowest_input_s']:.2f} s ({report['slowest_input']}); "
               f"peak RSS growth {report['peak_rss_growth_mb']:.0f} MB")
  for c in report["crash_examples"]:
    last = c["detail"].strip().splitlines()[-1] if c["detail"].strip() else ""
    lines.append(f"--- crash: {c['kind']} {c['mutation']}: {last}")
  return "\n".join(lines)

