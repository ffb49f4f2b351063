"""Tokenizer and chat template from a GGUF file's metadata, offline.

The vocabulary and merges become a byte-level BPE `tokenizers.Tokenizer`;
control tokens (token type 3, e.g. `<|im_start|>`) are special tokens matched
whole. The pre-tokenizer follows the file's `tokenizer.ggml.pre` name the way
llama.cpp does: `smollm` splits every digit on its own before GPT-2's regex.
The chat template is the Jinja2 template stored in the file, rendered with a
sandboxed environment, as transformers' `apply_chat_template` does.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from specjax.io import gguf as gguf_io

_CONTROL = 3

# llama.cpp pre-tokenizer names whose regex is GPT-2's with digits split first.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact"})


@dataclasses.dataclass
class Tokenizer:
  """A text <-> ids codec with the model's special ids and chat template."""

  backend: tokenizers.Tokenizer
  bos_id: int
  eos_id: int
  pad_id: int
  chat_template: Optional[str] = None
  add_bos: bool = False

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> List[int]:
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if self.add_bos if add_bos is None else add_bos:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to [{'role': ..., 'content': ...}, ...]."""
    if not self.chat_template:
      raise ValueError("this model has no chat template; pass raw text instead")
    for m in messages:
      if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(self.chat_template)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           bos_token=self.decode([self.bos_id]),
                           eos_token=self.decode([self.eos_id]))

  def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> List[int]:
    return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)

  def encode_prompt(self, prompt: str, system: Optional[str] = None) -> List[int]:
    """A single user turn through the chat template (the model's default system prompt)."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return self.encode_chat(messages)


def tokenizer_from_gguf(reader, path: str = "<gguf>") -> Tokenizer:
  """Build the tokenizer described by an open GGUF reader."""
  f = lambda k, d=None: gguf_io.field(reader, k, d)
  kind = f("tokenizer.ggml.model")
  if kind is None:
    raise gguf_io.GGUFError(f"{path}: no tokenizer metadata (tokenizer.ggml.model is missing)")
  if kind != "gpt2":
    raise gguf_io.GGUFError(
        f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
  tokens = f("tokenizer.ggml.tokens")
  merges = f("tokenizer.ggml.merges")
  types = f("tokenizer.ggml.token_type") or []
  if not tokens or merges is None:
    raise gguf_io.GGUFError(f"{path}: tokenizer vocabulary or merges are missing")
  if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
    raise gguf_io.GGUFError(f"{path}: tokenizer.ggml.tokens must be a list of strings")
  if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
    raise gguf_io.GGUFError(f"{path}: tokenizer.ggml.merges must be a list of 'a b' strings")
  if not isinstance(types, list) or not all(isinstance(t, int) for t in types):
    raise gguf_io.GGUFError(f"{path}: tokenizer.ggml.token_type must be a list of integers")
  vocab = {tok: i for i, tok in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise gguf_io.GGUFError(f"{path}: tokenizer.ggml.tokens holds duplicate tokens")
  merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
  ids = {key: gguf_io.int_field(reader, key, path, default, lo=0, hi=len(tokens) - 1)
         for key, default in (("tokenizer.ggml.bos_token_id", 1),
                              ("tokenizer.ggml.eos_token_id", 2))}
  ids["tokenizer.ggml.padding_token_id"] = gguf_io.int_field(
      reader, "tokenizer.ggml.padding_token_id", path, ids["tokenizer.ggml.eos_token_id"], lo=0,
      hi=len(tokens) - 1)
  template = f("tokenizer.chat_template")
  if template is not None and not isinstance(template, str):
    raise gguf_io.GGUFError(f"{path}: tokenizer.chat_template must be a string")
  try:
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    backend = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if f("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
      backend.pre_tokenizer = pre_tokenizers.Sequence(
          [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
      backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    specials = [tokenizers.AddedToken(tok, special=True, normalized=False)
                for tok, ty in zip(tokens, types) if ty == _CONTROL]
    backend.add_special_tokens(specials)
  except Exception as e:  # the tokenizers library rejects a vocabulary or merges
    raise gguf_io.GGUFError(f"{path}: cannot build the tokenizer: {type(e).__name__}: {e}") from e
  return Tokenizer(
      backend=backend,
      bos_id=ids["tokenizer.ggml.bos_token_id"],
      eos_id=ids["tokenizer.ggml.eos_token_id"],
      pad_id=ids["tokenizer.ggml.padding_token_id"],
      chat_template=template,
      add_bos=bool(f("tokenizer.ggml.add_bos_token", False)),
  )


def load_tokenizer(name_or_path: str) -> Tokenizer:
  path = gguf_io.resolve_model_path(name_or_path)
  return tokenizer_from_gguf(gguf_io.open_gguf(path), path)
