"""The file fuzzer's inputs: small valid files of every kind and their mutators.

`make_seeds` writes one small valid input of each kind (a GGUF file, an HF
directory with model.safetensors and config.json, a drafter checkpoint, a
prompt file) and records where their scalar fields and float32 weights lie;
the mutators (`mutate_bytes`, `mutate_json`, `mutate_safetensors_header`,
`mutate_prompts`) turn a valid input into a malformed one. Every choice is
drawn through a `draw(lo, hi) -> int` callback. The harness that loads the
mutants and checks what comes out is specjax.testing.fuzz.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Callable, List, Optional

import jax
import numpy as np

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
