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

from specjax.peers import hf

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_BENCH = os.path.normpath(os.path.join(_REPO, os.pardir, "shared", "data", "spec_bench",
                                           "question_excl_mtbench.jsonl"))


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"  # a model name, GGUF file or HF directory
  c.tokenizer_from = ""  # for an HF directory: the model name / GGUF holding the tokenizer
  c.dtype = "bfloat16"  # specjax's precision
  c.hf_dtype = "float32"  # the HF peer's (the GGUF dequantized by transformers)
  c.prompts = SPEC_BENCH
  c.prompt_limit = 2  # per category (0: all)
  c.max_new_tokens = 128
  c.repeats = 3  # timed runs per system and question, interleaved; the median counts
  c.threads = 0  # torch / llama.cpp threads (0: all CPU cores)
  c.hf = hf.available()  # the HF transformers peer (the `peers` extra)
  c.llamacpp = True  # the llama.cpp peer, when llama-cpp-python is installed
  c.llamacpp_ctx = 4096  # llama.cpp context (prompt + new tokens + guesses)
  # Drafter fields (specjax.drafters.registry); like for like: specjax's draft_model
  # and HF's assistant draft k tokens with the same model; both prompt lookups
  # propose lookup_k tokens after an n-gram of max_ngram down to 1 tokens.
  common.drafter_fields(c)
  c.lookup_k = 4
  c.hf_draft = ""  # the assistant's HF directory ('': exported from draft_model)
  # specjax's best method, its own row (any registry name); when it names a like-for-like
  # row (e.g. 'prompt_lookup@k=4@max_ngram=3@min_ngram=1') that row is marked '(best)'
  c.best = "eagle3@k=2"
  c.out = "/tmp/specjax_peers"
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
