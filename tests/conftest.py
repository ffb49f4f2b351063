"""Session-wide fixtures: expensive things are built once per test session.

  smollm2      the real SmolLM2-135M-Instruct GGUF loaded by specjax (~10 s)
  hf_smollm2   the same file loaded by transformers (float32, eval) + its tokenizer
  tiny_gguf    a tiny llama GGUF written with gguf.GGUFWriter: known params, mixed
               quantization types, SmolLM2's tokenizer metadata

Add new fixtures at the end, one block each.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import gguf
import jax
import numpy as np
import pytest

import specjax
from specjax.io import gguf as gguf_io
from specjax.io.load import load_model
from specjax.models import transformer
from specjax.models.config import ModelConfig

jax.config.update("jax_enable_x64", False)
# Compiles dominate the suite's time on a 2-core CPU: keep XLA executables in a
# persistent cache, so a second run on the same machine skips them. A cold
# cache only costs the compiles themselves; results never depend on it.
specjax.use_compilation_cache()

SMOLLM2 = "smollm2-135m"


# --- the real model --------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
  """specjax.io.load.Model of SmolLM2-135M-Instruct (float32)."""
  return load_model(SMOLLM2)


class HFModel(NamedTuple):
  model: object  # transformers LlamaForCausalLM, float32, eval mode
  tokenizer: object  # transformers tokenizer built from the GGUF metadata


@pytest.fixture(scope="session")
def hf_smollm2() -> HFModel:
  """The same GGUF file, dequantized by transformers: an independent reference."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  folder, name = os.path.split(gguf_io.resolve_model_path(SMOLLM2))
  with pytest.MonkeyPatch.context() as mp:
    # Speed only (the same bytes and names come out): transformers parses the
    # file three times and rebuilds gguf's tensor-name map for each of ~400
    # modules (~15 s).
    mp.setattr(gguf, "GGUFReader", _plain_array_reader())
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(
        gguf.get_tensor_name_map))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return HFModel(model, tokenizer)


def _plain_array_reader():
  """gguf.GGUFReader parsing a plain-ndarray view of its np.memmap.

  transformers parses the file three times (config, weights, tokenizer), and each
  parse slices the memmap ~500k times, paying memmap.__array_finalize__ every time
  (~10 s per parse on this CPU). The view holds the same bytes: same fields, same
  tensors, ~3x faster. Written here rather than imported from specjax so the
  reference stays independent of the code under test.
  """

  class Reader(gguf.GGUFReader):

    @property
    def data(self):
      return self._data

    @data.setter
    def data(self, value):
      self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

  return Reader


# --- a tiny GGUF written in the session -------------------------------------------

# One quantization type per tensor, covering every type gguf.quants can write
# for 64-wide rows (the K-quants need rows of 256). Layer 0 keeps Q and K in F32
# so the rotary un-permutation can be checked bit for bit.
TINY_QTYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q8_0",  # written only when the LM head is not tied
    "output_norm.weight": "F32",
    "blk.0.attn_norm.weight": "F32",
    "blk.0.attn_q.weight": "F32",
    "blk.0.attn_k.weight": "F32",
    "blk.0.attn_v.weight": "F16",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_norm.weight": "F32",
    "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_1",
    "blk.1.attn_norm.weight": "F32",
    "blk.1.attn_q.weight": "Q4_1",
    "blk.1.attn_k.weight": "Q4_1",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "F32",
    "blk.1.ffn_norm.weight": "F32",
    "blk.1.ffn_gate.weight": "Q5_1",
    "blk.1.ffn_up.weight": "Q4_0",
    "blk.1.ffn_down.weight": "BF16",
}

_TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                   "tokenizer.chat_template")


def tiny_model_config(**overrides):
  """SmolLM2's vocabulary on a 2-layer, 64-wide llama (float32-exact hyper-parameters,
  so the config read back compares equal)."""
  base = dict(vocab_size=49152, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              ffn_dim=128, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True,
              max_seq_len=512, bos_id=1, eos_id=2, pad_id=2)
  base.update(overrides)
  return ModelConfig(**base)


def tiny_params(cfg, seed: int = 0) -> dict:
  """specjax params (numpy float32) with non-trivial norm scales: all-ones norms
  would hide a swap of the attention / MLP / final norms."""
  params = jax.tree.map(np.asarray, transformer.init(jax.random.key(seed), cfg))
  rng = np.random.default_rng(seed)
  scale = lambda: (1.0 + 0.3 * rng.standard_normal(cfg.dim)).astype(np.float32)
  for layer in params["layers"]:
    layer["attn_norm"], layer["mlp_norm"] = scale(), scale()
  params["final_norm"] = scale()
  return params


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py), (out, in) HF orientation:
  the inverse of specjax.io.gguf._unpermute_rotary."""
  out, inp = w.shape
  return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_tensors(cfg, params: dict) -> Dict[str, np.ndarray]:
  """specjax params -> GGUF tensors (HF (out, in) orientation, Q/K rows permuted)."""
  h, g, dh, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  out = {"token_embd.weight": params["embed"]}
  for i, p in enumerate(params["layers"]):
    wqkv = p["wqkv"]
    out.update({
        f"blk.{i}.attn_norm.weight": p["attn_norm"],
        f"blk.{i}.attn_q.weight": permute_rotary(wqkv[:h * dh], h),
        f"blk.{i}.attn_k.weight": permute_rotary(wqkv[h * dh:(h + g) * dh], g),
        f"blk.{i}.attn_v.weight": wqkv[(h + g) * dh:],
        f"blk.{i}.attn_output.weight": p["wo"],
        f"blk.{i}.ffn_norm.weight": p["mlp_norm"],
        f"blk.{i}.ffn_gate.weight": p["w_gate_up"][:f],
        f"blk.{i}.ffn_up.weight": p["w_gate_up"][f:],
        f"blk.{i}.ffn_down.weight": p["w_down"],
    })
  if not cfg.tie_embeddings:
    out["output.weight"] = params["lm_head"]
  out["output_norm.weight"] = params["final_norm"]  # last: 256 bytes, no trailing padding
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_llama_gguf(path, cfg, params: dict, tokenizer_fields: Optional[dict], *,
                     qtypes: Optional[Dict[str, str]] = None, arch: str = "llama",
                     skip: Sequence[str] = (), nan_in: Optional[str] = None) -> str:
  """Write a llama GGUF file the way llama.cpp's converter lays it out.

  Args:
    tokenizer_fields: contents of the `_TOKENIZER_KEYS` metadata (from a real file);
      None writes no vocabulary (a file for specjax.io.gguf.load_gguf only, ~3x
      faster to write and parse: the 98k tokenizer strings dominate both).
    qtypes: GGUF tensor name -> gguf.GGMLQuantizationType name (default TINY_QTYPES).
    arch: general.architecture (and the metadata key prefix).
    skip: tensor names to leave out.
    nan_in: a tensor name whose first value is set to NaN before quantization.
  """
  qtypes = {**TINY_QTYPES, **(qtypes or {})}
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.dim)
  w.add_block_count(cfg.num_layers)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  if tokenizer_fields is not None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
    w.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
    w.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer_fields["tokenizer.chat_template"])
  w.add_bos_token_id(cfg.bos_id)
  w.add_eos_token_id(cfg.eos_id)
  w.add_pad_token_id(cfg.pad_id)
  for name, x in gguf_tensors(cfg, params).items():
    if name in skip:
      continue
    if name == nan_in:
      x = x.copy()
      x.flat[0] = np.nan
    qtype = gguf.GGMLQuantizationType[qtypes[name]]
    data = gguf.quants.quantize(x, qtype)
    w.add_tensor(name, data, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@dataclasses.dataclass(frozen=True)
class TinyGGUF:
  """A GGUF file written in this session, with what went into it."""

  path: str
  cfg: object  # ModelConfig that was written
  params: dict  # the float32 originals (specjax layout), before quantization
  qtypes: Dict[str, str]  # GGUF tensor name -> quantization type name
  tokenizer_fields: dict
  # write(path, cfg=..., params=..., tokenizer=True, **write_llama_gguf options)
  # -> another file; cfg / params default to this file's.
  write: Callable[..., str]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> TinyGGUF:
  reader = gguf_io.open_gguf(gguf_io.resolve_model_path(SMOLLM2))
  tokenizer_fields = {k: gguf_io.field(reader, k) for k in _TOKENIZER_KEYS}
  del reader
  cfg = tiny_model_config()
  params = tiny_params(cfg)

  def write(path, cfg=cfg, params=params, tokenizer=True, **options):
    return write_llama_gguf(path, cfg, params, tokenizer_fields if tokenizer else None,
                            **options)

  path = write(tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf")
  return TinyGGUF(path=path, cfg=cfg, params=params, qtypes=dict(TINY_QTYPES),
                  tokenizer_fields=tokenizer_fields, write=write)


# --- run configs -------------------------------------------------------------------

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "configs")


@pytest.fixture(scope="session")
def load_config():
  """load_config("medusa.py", "tiny", workdir=...) -> the config file's
  get_config(variant) with fields overridden."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  def load(filename, variant=None, **overrides):
    spec = importlib.util.spec_from_file_location(f"config_{filename[:-3]}",
                                                  os.path.join(CONFIGS_DIR, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(variant)
    for k, v in overrides.items():
      setattr(c, k, str(v) if k in ("workdir", "export") else v)
    return c
  return load


# --- process resources ---------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """Drop JAX's in-memory compiled executables after each test module.

  The whole suite runs in one process; on the 2-core CI machine XLA aborted
  (SIGABRT while compiling, no message, no OOM) once several hundred
  executables were alive, at a different test each run. Executables shared
  within a module stay shared; across modules the persistent compilation
  cache (above) reloads them from disk instead of recompiling."""
  yield
  jax.clear_caches()
  import gc  # pylint: disable=import-outside-toplevel
  gc.collect()
