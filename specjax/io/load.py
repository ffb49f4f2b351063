"""One entry point for loading a target model by name, GGUF path or HF directory."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from specjax.errors import ConfigValueError
from specjax.io import gguf as gguf_io
from specjax.io import tokenizer as tokenizer_lib
from specjax.models import invariant as invariant_lib
from specjax.models.config import MAX_INVARIANT_TILE, ModelConfig


@dataclasses.dataclass
class Model:
  """A loaded model: params pytree, static config, tokenizer (may be None)."""

  params: dict
  cfg: ModelConfig
  tokenizer: Optional[tokenizer_lib.Tokenizer]
  source: str


def load_model(name_or_path: str, dtype: Optional[str] = None,
               tokenizer_from: Optional[str] = None, batch_invariant: Optional[bool] = None,
               invariant_tile: int = 0) -> Model:
  """Load a model offline.

  Args:
    name_or_path: a known model name ('smollm2-135m'), a .gguf file, or an
      HF-format directory (config.json + safetensors).
    dtype: 'float32' or 'bfloat16' (default: float32).
    tokenizer_from: model name or GGUF path to take the tokenizer from when
      the weights come from an HF directory (specjax reads tokenizers from GGUF
      metadata only).
    batch_invariant: decode-time forwards computed bit for bit independently
      of the block a row is in (`ModelConfig.batch_invariant`). None: the
      precision's default (`specjax.models.invariant.default_for`: on for
      bfloat16 where the CPU kernels run, else off).
    invariant_tile: rows per tile of the batch-invariant forward
      (`ModelConfig.invariant_tile`; 0: the precision's default). Needs
      `batch_invariant`.
  """
  dtype = dtype or "float32"
  if dtype not in ("float32", "bfloat16"):
    raise ConfigValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
  if batch_invariant is None:
    batch_invariant = invariant_lib.default_for(dtype)
  if invariant_tile and not batch_invariant:
    raise ConfigValueError(f"invariant_tile={invariant_tile} sizes the batch-invariant forward's "
                           "tiles; it needs batch_invariant=True")
  if not 0 <= int(invariant_tile) <= MAX_INVARIANT_TILE:
    raise ConfigValueError(f"invariant_tile must be 0 (the precision's default) or "
                           f"1..{MAX_INVARIANT_TILE} rows, got {invariant_tile}")
  inv = dict(batch_invariant=bool(batch_invariant), invariant_tile=int(invariant_tile))
  if os.path.isdir(name_or_path):
    from specjax.io import hf  # pylint: disable=import-outside-toplevel

    params, cfg = hf.load_hf(name_or_path, dtype=dtype)
    cfg = cfg.replace(**inv)
    tok = tokenizer_lib.load_tokenizer(tokenizer_from) if tokenizer_from else None
    _check_vocab(tok, cfg, f"tokenizer_from={tokenizer_from!r}", name_or_path)
    return Model(params, cfg, tok, name_or_path)
  path = gguf_io.resolve_model_path(name_or_path)
  reader = gguf_io.open_gguf(path)
  cfg = gguf_io.read_config(reader, path).replace(dtype=dtype, **inv)
  tok = tokenizer_lib.tokenizer_from_gguf(reader, path)
  _check_vocab(tok, cfg, "its tokenizer", path)
  params = gguf_io.load_params(reader, cfg, path)
  return Model(params, cfg, tok, path)


def _check_vocab(tok: Optional[tokenizer_lib.Tokenizer], cfg: ModelConfig, what: str,
                 source: str) -> None:
  """A tokenizer may have fewer tokens than the model's embedding rows (padded
  vocabularies), never more: its ids past the rows would read no embedding."""
  if tok is not None and tok.vocab_size > cfg.vocab_size:
    raise ConfigValueError(f"{source}: {what} has {tok.vocab_size} tokens but the model's "
                           f"vocabulary has {cfg.vocab_size}: the tokenizer is not this model's")
