"""Load and save HF-format Llama-family directories (config.json + safetensors).

HF stores every projection as a torch `nn.Linear` weight, (out, in), and so
does specjax; Q/K/V and gate/up are fused on the output axis (see `specjax.models.transformer`). HF's Q/K rows are already
in the rotate-half RoPE layout specjax uses: no row permutation (unlike GGUF).

Loading converts one tensor at a time and drops the host copy, so peak host
memory stays near one layer. Saving writes into a temporary directory next to
the target and renames it into place, so a crash never leaves a half-written
model behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
# Importing ml_dtypes registers the name "bfloat16" with numpy; without it
# safetensors' numpy API cannot read BF16 tensors ("data type not understood").
import ml_dtypes  # noqa: F401  pylint: disable=unused-import
import numpy as np
import safetensors
import safetensors.numpy

from specjax.errors import MalformedFileError
from specjax.io import jsonl
from specjax.models.config import ModelConfig

Params = dict

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

# HF dtype names -> the parameter dtype specjax loads by default. float16 is
# widened to float32 (ModelConfig supports float32 and bfloat16 only, and
# float16 -> bfloat16 would drop mantissa bits).
_DEFAULT_LOAD_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


class HFFormatError(MalformedFileError):
  """An HF model directory is missing, malformed or not a supported architecture."""


# ----------------------------------------------------------------------------
# config.json <-> ModelConfig


def _rope_theta(raw: Mapping[str, Any], path: str) -> float:
  """rope_theta from a transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
  (`rope_parameters`) config; refuses any RoPE scaling, which specjax's `rope`
  does not implement (loading it anyway would give silently wrong logits)."""
  params = raw.get("rope_parameters") or {}
  scaling = raw.get("rope_scaling") or {}
  if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
    raise HFFormatError(f"{path}: rope_parameters / rope_scaling must be JSON objects")
  kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
  if kind != "default":
    raise HFFormatError(
        f"{path}: RoPE scaling type {kind!r} is not supported (only plain RoPE, "
        "rope_type 'default'); loading it would give wrong logits at every position")
  theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
  return _number(theta, "rope_theta", path)


# Integer hyper-parameters and token ids: int32 on device.
_MAX_INT = 2 ** 31 - 1


def _short(v: Any) -> str:
  r = repr(v)
  return r if len(r) <= 60 else r[:57] + "..."


def _integer(value: Any, key: str, path: str, lo: int = 1, hi: int = _MAX_INT) -> int:
  """A JSON integer in [lo, hi] (an integral float such as 2048.0 too)."""
  if isinstance(value, float) and math.isfinite(value) and value == int(value):
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise HFFormatError(f"{path}: {key} must be an integer, got {_short(value)}")
  if not lo <= value <= hi:
    raise HFFormatError(f"{path}: {key}={value} is out of range [{lo}, {hi}]")
  return value


def _number(value: Any, key: str, path: str) -> float:
  """A positive finite JSON number."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise HFFormatError(f"{path}: {key} must be a number, got {_short(value)}")
  if not (math.isfinite(value) and value > 0):
    raise HFFormatError(f"{path}: {key}={value} must be positive and finite")
  return float(value)


def _flag(raw: Mapping[str, Any], key: str, path: str) -> bool:
  value = raw.get(key)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise HFFormatError(f"{path}: {key} must be true or false, got {_short(value)}")
  return value


def _first_id(value: Any, key: str = "token id", path: str = "<config.json>",
              vocab: int = _MAX_INT) -> Optional[int]:
  """A token id from config.json; a list (several EOS ids) gives its first.
  -1 (some configs' way of saying none) is kept."""
  if isinstance(value, (list, tuple)):
    value = value[0] if value else None
  return None if value is None else _integer(value, key, path, lo=-1, hi=vocab - 1)


def config_from_dict(raw: Mapping[str, Any], path: str = "<config.json>",
                     dtype: Optional[str] = None) -> ModelConfig:
  """A parsed HF config.json -> ModelConfig.

  `dtype` (default: the file's `dtype` / `torch_dtype`, float16 widened to
  float32) becomes `ModelConfig.dtype`.
  """
  model_type = raw.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise HFFormatError(f"{path}: model_type {model_type!r} is not supported "
                        f"(expected one of {list(SUPPORTED_MODEL_TYPES)})")
  archs = raw.get("architectures") or []
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise HFFormatError(f"{path}: architectures must be a list of names, got {_short(archs)}")
  if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
    raise HFFormatError(f"{path}: architectures {archs} are not supported "
                        f"(expected one of {list(SUPPORTED_ARCHITECTURES)})")
  max_pos = _integer(raw.get("max_position_embeddings", 2048), "max_position_embeddings", path)
  window = raw.get("sliding_window")
  if window is not None and _integer(window, "sliding_window", path) < max_pos:
    raise HFFormatError(
        f"{path}: sliding_window={window} is not supported (full attention only); "
        f"a window of at least max_position_embeddings={max_pos} or null is")
  if raw.get("hidden_act", "silu") != "silu":
    raise HFFormatError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
  for flag in ("attention_bias", "mlp_bias"):
    if raw.get(flag):
      raise HFFormatError(f"{path}: {flag}=true is not supported (bias-free Llama only)")

  def need(key):
    if raw.get(key) is None:
      raise HFFormatError(f"{path}: required key {key!r} is missing")
    return _integer(raw[key], key, path)

  def optional(key, default):
    return default if raw.get(key) is None else _integer(raw[key], key, path)

  dim, heads = need("hidden_size"), need("num_attention_heads")
  vocab = need("vocab_size")
  if dtype is None:
    src = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    if src not in _DEFAULT_LOAD_DTYPE:
      raise HFFormatError(f"{path}: dtype {src!r} is not supported "
                          f"(expected one of {sorted(_DEFAULT_LOAD_DTYPE)})")
    dtype = _DEFAULT_LOAD_DTYPE[src]
  eos = _first_id(raw.get("eos_token_id"), "eos_token_id", path, vocab)
  ids = dict(bos_id=_first_id(raw.get("bos_token_id"), "bos_token_id", path, vocab), eos_id=eos,
             pad_id=_first_id(raw.get("pad_token_id"), "pad_token_id", path, vocab))
  if ids["pad_id"] is None:
    ids["pad_id"] = eos  # HF Llama checkpoints usually have no pad token.
  try:
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=optional("num_key_value_heads", heads),
        head_dim=optional("head_dim", max(dim // heads, 1)),
        ffn_dim=need("intermediate_size"),
        rope_theta=_rope_theta(raw, path),
        norm_eps=_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", path),
        tie_embeddings=_flag(raw, "tie_word_embeddings", path),
        max_seq_len=max_pos,
        dtype=jnp.dtype(dtype).name,
        **{k: v for k, v in ids.items() if v is not None},
    )
  except ValueError as e:  # ModelConfig's own consistency checks
    if isinstance(e, HFFormatError):
      raise
    raise HFFormatError(f"{path}: invalid config: {e}") from e


def config_to_dict(cfg: ModelConfig) -> Dict[str, Any]:
  """ModelConfig -> an HF LlamaForCausalLM config.json dict.

  Writes both the transformers 4.x (`rope_theta`, `torch_dtype`) and 5.x
  (`rope_parameters`, `dtype`) spellings, so either version reads it.
  """
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.ffn_dim,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_seq_len,
      "bos_token_id": cfg.bos_id,
      "eos_token_id": cfg.eos_id,
      "pad_token_id": cfg.pad_id,
      "torch_dtype": cfg.dtype,
      "dtype": cfg.dtype,
  }


def read_config(path: str, dtype: Optional[str] = None) -> ModelConfig:
  """The ModelConfig of an HF model directory (reads config.json only)."""
  if not os.path.isdir(path):
    raise HFFormatError(f"HF model directory not found: {path}")
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise HFFormatError(f"{path}: no {CONFIG_FILE} (not an HF model directory)")
  return config_from_dict(jsonl.read_object(file, HFFormatError), file, dtype)


# ----------------------------------------------------------------------------
# Tensor names and shapes


def expected_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
  """HF tensor name -> shape (torch (out, in) orientation) for `cfg`."""
  d, f, dh = cfg.dim, cfg.ffn_dim, cfg.head_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    shapes.update({
        pre + "self_attn.q_proj.weight": (cfg.num_heads * dh, d),
        pre + "self_attn.k_proj.weight": (cfg.num_kv_heads * dh, d),
        pre + "self_attn.v_proj.weight": (cfg.num_kv_heads * dh, d),
        pre + "self_attn.o_proj.weight": (d, cfg.num_heads * dh),
        pre + "mlp.gate_proj.weight": (f, d),
        pre + "mlp.up_proj.weight": (f, d),
        pre + "mlp.down_proj.weight": (d, f),
        pre + "input_layernorm.weight": (d,),
        pre + "post_attention_layernorm.weight": (d,),
    })
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  return shapes


def to_hf_tensors(params: Params, cfg: ModelConfig) -> Iterator[Tuple[str, np.ndarray]]:
  """(HF name, host tensor in torch orientation) for every tensor of `params`.

  Splits and transposes run in numpy, one tensor at a time: no device memory
  and no per-shape XLA compiles.
  """
  hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  host = np.asarray
  yield "model.embed_tokens.weight", host(params["embed"])
  for i, p in enumerate(params["layers"]):
    pre = f"model.layers.{i}."
    wq, wk, wv = np.split(host(p["wqkv"]), [hq, hq + hkv], axis=0)
    gate, up = np.split(host(p["w_gate_up"]), 2, axis=0)
    yield pre + "self_attn.q_proj.weight", wq
    yield pre + "self_attn.k_proj.weight", wk
    yield pre + "self_attn.v_proj.weight", wv
    yield pre + "self_attn.o_proj.weight", host(p["wo"])
    yield pre + "mlp.gate_proj.weight", gate
    yield pre + "mlp.up_proj.weight", up
    yield pre + "mlp.down_proj.weight", host(p["w_down"])
    yield pre + "input_layernorm.weight", host(p["attn_norm"])
    yield pre + "post_attention_layernorm.weight", host(p["mlp_norm"])
  yield "model.norm.weight", host(params["final_norm"])
  if not cfg.tie_embeddings:
    yield "lm_head.weight", host(params["lm_head"])


# ----------------------------------------------------------------------------
# Loading


def _weight_map(path: str) -> Dict[str, str]:
  """Tensor name -> safetensors file, from model.safetensors or the shard index."""
  single = os.path.join(path, WEIGHTS_FILE)
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(single):  # transformers' order: a single file wins over an index
    with _open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
      files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
      raise HFFormatError(f"{index}: malformed shard index: {type(e).__name__}: {e}") from e
    for file in sorted(set(files.values())):
      if not os.path.isfile(file):
        raise HFFormatError(f"{index}: shard {os.path.basename(file)} is missing")
    return files
  others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".gguf")))
  hint = f" (found {others}: only safetensors weights are supported)" if others else ""
  raise HFFormatError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def _open_safetensors(file: str):
  try:
    return safetensors.safe_open(file, framework="np")
  except Exception as e:  # SafetensorError, OSError, ... on corrupt or truncated files
    raise HFFormatError(f"{file} is a corrupt or truncated safetensors file: "
                        f"{type(e).__name__}: {e}") from e


class _TensorReader:
  """Reads named tensors as numpy arrays, opening each shard once, checking
  presence, shape and finiteness with errors that name the file and tensor."""

  def __init__(self, path: str, files: Dict[str, str],
               shapes: Dict[str, Tuple[int, ...]], stack: contextlib.ExitStack):
    self._path, self._files, self._shapes, self._stack = path, files, shapes, stack
    self._open: Dict[str, Any] = {}

  def __call__(self, name: str) -> np.ndarray:
    file = self._files.get(name)
    if file is None:
      raise HFFormatError(f"{self._path}: tensor {name} is missing")
    if file not in self._open:
      self._open[file] = self._stack.enter_context(_open_safetensors(file))
    try:
      w = self._open[file].get_tensor(name)
    except Exception as e:
      raise HFFormatError(f"{file}: cannot read tensor {name} (corrupt or truncated "
                          f"file?): {type(e).__name__}: {e}") from e
    if w.shape != self._shapes[name]:
      raise HFFormatError(f"{file}: tensor {name} has shape {tuple(w.shape)}, "
                          f"expected {self._shapes[name]}")
    if not np.issubdtype(w.dtype, np.floating) and w.dtype != ml_dtypes.bfloat16:
      raise HFFormatError(f"{file}: tensor {name} has dtype {w.dtype}, expected a float type")
    if not np.isfinite(w).all():
      raise HFFormatError(f"{file}: tensor {name} contains NaN or inf values")
    return w


def load_hf(path: str, dtype: Optional[str] = None) -> Tuple[Params, ModelConfig]:
  """Load (params, config) from an HF-format Llama-family directory.

  Args:
    path: a directory with config.json and model.safetensors (or a sharded
      model.safetensors.index.json).
    dtype: parameter dtype, "float32" or "bfloat16"; default the checkpoint's
      own (float16 checkpoints load as float32). Also becomes `cfg.dtype`.

  Raises:
    HFFormatError: missing directory / files / tensors, unsupported config,
      wrong shapes, NaN or inf weights, corrupt safetensors files.
  """
  cfg = read_config(path, dtype)
  files = _weight_map(path)
  shapes = expected_shapes(cfg)
  np_dtype = np.dtype(cfg.jnp_dtype)

  with contextlib.ExitStack() as stack:
    get = _TensorReader(path, files, shapes, stack)

    def put(*names: str) -> jax.Array:
      """The named tensors, (out, in), fused on the output axis, as one
      device array; host copies are dropped on return."""
      parts = [get(n).astype(np_dtype, copy=False) for n in names]
      w = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
      return jnp.asarray(w)

    layers = []
    for i in range(cfg.num_layers):
      pre = f"model.layers.{i}."
      layers.append(dict(
          attn_norm=put(pre + "input_layernorm.weight"),
          wqkv=put(*(pre + f"self_attn.{x}_proj.weight" for x in "qkv")),
          wo=put(pre + "self_attn.o_proj.weight"),
          mlp_norm=put(pre + "post_attention_layernorm.weight"),
          w_gate_up=put(pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"),
          w_down=put(pre + "mlp.down_proj.weight"),
      ))
    params = dict(embed=put("model.embed_tokens.weight"), layers=layers,
                  final_norm=put("model.norm.weight"))
    if not cfg.tie_embeddings:
      params["lm_head"] = put("lm_head.weight")
  return params, cfg


# ----------------------------------------------------------------------------
# Saving


def _fsync_file(file: str) -> None:
  with open(file, "rb") as f:
    os.fsync(f.fileno())


def save_hf(path: str, params: Params, cfg: ModelConfig, *,
            extra_config: Optional[Mapping[str, Any]] = None,
            overwrite: bool = False) -> None:
  """Write `params` as an HF LlamaForCausalLM directory (config.json +
  model.safetensors), loadable by `load_hf` and by transformers.

  Tensors are written in `cfg.dtype`. With a tied embedding no lm_head is
  written and tie_word_embeddings is true. The directory is built under a
  temporary name next to `path` and renamed into place, so `path` either does
  not exist or holds a complete model, whatever happens mid-write.

  Args:
    extra_config: extra config.json keys (e.g. for a tokenizer); they may not
      change a key derived from `cfg`.
    overwrite: replace an existing non-empty `path` (its whole contents);
      without it such a `path` is refused.
  """
  path = os.path.abspath(path)
  config = config_to_dict(cfg)
  for key, value in (extra_config or {}).items():
    if key in config and config[key] != value:
      raise ValueError(f"extra_config[{key!r}]={value!r} conflicts with the value "
                       f"{config[key]!r} derived from the ModelConfig")
    config[key] = value
  if os.path.exists(path) and not os.path.isdir(path):
    raise FileExistsError(f"{path} exists and is not a directory")
  if os.path.isdir(path) and os.listdir(path) and not overwrite:
    raise FileExistsError(f"{path} is a non-empty directory; pass overwrite=True to replace it")

  shapes = expected_shapes(cfg)
  np_dtype = np.dtype(cfg.jnp_dtype)
  tensors = {}
  for name, w in to_hf_tensors(params, cfg):
    if name not in shapes or tuple(w.shape) != shapes[name]:
      raise ValueError(f"params do not match the config: {name} has shape "
                       f"{tuple(w.shape)}, expected {shapes.get(name)}")
    tensors[name] = np.ascontiguousarray(w.astype(np_dtype, copy=False))

  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    weights = os.path.join(tmp, WEIGHTS_FILE)
    safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})
    del tensors
    with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, sort_keys=True)
      f.write("\n")
    for file in (weights, os.path.join(tmp, CONFIG_FILE)):
      _fsync_file(file)
    if os.path.isdir(path) and os.listdir(path):
      # rename() replaces only an empty directory: move the old one aside first.
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
      os.replace(path, old)
      try:
        os.replace(tmp, path)
      except BaseException:
        os.replace(old, path)
        raise
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
