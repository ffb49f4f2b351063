"""specjax side by side with HF transformers and llama.cpp (specjax/benchmarks/peers.py).

Usage:
  python experiments/peers.py --config=configs/peers.py
  python experiments/peers.py --config=configs/peers.py:quick --config.out=/tmp/peers_quick
  python experiments/peers.py --config=configs/peers.py --config.best=eagle3_tree \
      --config.k=3 --config.lookup_k=8 --config.max_ngram=2

Variants (the text after ':'), combinable with '+':
  quick   1 prompt per category, 32 new tokens, 1 repeat
  f32     specjax in float32 (the default is bfloat16, its faster setting here)

The HF assistant is the draft model specjax's draft_model method uses (the
distilled one shipped for SmolLM2-135M unless `draft_model` says otherwise),
exported to `out`/hf_draft, or `hf_draft` (an HF directory). A run resumes
from `out`/log.jsonl; change `out` when changing the settings.
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import peers

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.peers.PeersSettings
  # (model, tokenizer_from, dtype, hf_dtype, prompts (Spec-Bench), prompt_limit,
  # max_new_tokens, repeats, threads, hf, llamacpp, llamacpp_ctx, lookup_k,
  # hf_draft, best, out), and the drafters' (k, max_ngram, draft_model, ...: the
  # like-for-like rows and the best method read them).
  common.settings_fields(c, peers.PeersSettings)
  for variant in (arg or "").split("+"):
    if not variant:
      continue
    if variant == "quick":
      c.prompt_limit, c.max_new_tokens, c.repeats = 1, 32, 1
    elif variant == "f32":
      c.dtype = "float32"
    else:
      raise ValueError(f"unknown variant {variant!r} of configs/peers.py (quick, f32)")
  c.lock()
  return c
