"""Write specjax params as a llama GGUF file, laid out the way llama.cpp's
converter writes one (HF (out, in) tensor orientation, Q/K rows permuted for
its rotary convention, the metadata keys specjax.io.gguf reads).

The inverse of specjax.io.gguf.load_gguf for the tensors' values (up to each
tensor's quantization): tests write known params and read them back, and the
fuzzer (specjax.testing.fuzz) writes the valid files it then corrupts.

  write_llama_gguf(path, cfg, params, tokenizer=TokenizerFields(...),
                   qtypes={"blk.0.ffn_gate.weight": "Q4_1", ...})
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

# The metadata keys of a GGUF vocabulary (what TokenizerFields.from_reader reads).
TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.chat_template")


@dataclasses.dataclass(frozen=True)
class TokenizerFields:
  """A byte-level BPE vocabulary as GGUF stores it ('gpt2' model)."""

  tokens: Sequence[str]
  token_types: Sequence[int]
  merges: Sequence[str]
  chat_template: str
  pre: str = "smollm"

  @classmethod
  def from_reader(cls, reader) -> "TokenizerFields":
    """The vocabulary of an open GGUF file (specjax.io.gguf.open_gguf)."""
    from specjax.io import gguf as gguf_io  # pylint: disable=import-outside-toplevel
    tokens, types, merges, template = (gguf_io.field(reader, k) for k in TOKENIZER_KEYS)
    return cls(tokens=tokens, token_types=types, merges=merges, chat_template=template)


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's Q/K row permutation, on (out, in) HF-oriented rows: the
  inverse of specjax.io.gguf._unpermute_rotary."""
  out, inp = w.shape
  return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_tensors(cfg, params: dict) -> Dict[str, np.ndarray]:
  """specjax params -> GGUF tensors, float32, in the converter's order."""
  h, g, dh, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  host = lambda x: np.asarray(x, np.float32)  # noqa: E731
  out = {"token_embd.weight": params["embed"]}
  for i, p in enumerate(params["layers"]):
    wqkv, gate_up = host(p["wqkv"]), host(p["w_gate_up"])
    out.update({
        f"blk.{i}.attn_norm.weight": p["attn_norm"],
        f"blk.{i}.attn_q.weight": permute_rotary(wqkv[:h * dh], h),
        f"blk.{i}.attn_k.weight": permute_rotary(wqkv[h * dh:(h + g) * dh], g),
        f"blk.{i}.attn_v.weight": wqkv[(h + g) * dh:],
        f"blk.{i}.attn_output.weight": p["wo"],
        f"blk.{i}.ffn_norm.weight": p["mlp_norm"],
        f"blk.{i}.ffn_gate.weight": gate_up[:f],
        f"blk.{i}.ffn_up.weight": gate_up[f:],
        f"blk.{i}.ffn_down.weight": p["w_down"],
    })
  if not cfg.tie_embeddings:
    out["output.weight"] = params["lm_head"]
  out["output_norm.weight"] = params["final_norm"]  # last: 256 bytes, no trailing padding
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_llama_gguf(path, cfg, params: dict, *, tokenizer: Optional[TokenizerFields] = None,
                     qtypes: Optional[Mapping[str, str]] = None, arch: str = "llama",
                     skip: Sequence[str] = (), nan_in: Optional[str] = None) -> str:
  """Write `params` (specjax layout) with `cfg`'s hyper-parameters to `path`.

  Args:
    tokenizer: the vocabulary to store (None: none; a file only
      specjax.io.gguf.load_gguf can use, faster to write and parse).
    qtypes: GGUF tensor name -> gguf.GGMLQuantizationType name; F32 where absent.
    arch: general.architecture (and the metadata key prefix).
    skip: tensor names to leave out.
    nan_in: a tensor name whose first value is set to NaN before quantization.
  -> str(path)
  """
  import gguf  # pylint: disable=import-outside-toplevel
  qtypes = dict(qtypes or {})
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
  if tokenizer is not None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer.pre)
    w.add_token_list(tokenizer.tokens)
    w.add_token_types(tokenizer.token_types)
    w.add_token_merges(tokenizer.merges)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
  w.add_bos_token_id(cfg.bos_id)
  w.add_eos_token_id(cfg.eos_id)
  w.add_pad_token_id(cfg.pad_id)
  for name, x in gguf_tensors(cfg, params).items():
    if name in skip:
      continue
    if name == nan_in:
      x = x.copy()
      x.flat[0] = np.nan
    qtype = gguf.GGMLQuantizationType[qtypes.get(name, "F32")]
    w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)
