"""The Spec-Bench protocol: speculative methods against the AR baseline, per category.

Usage:
  python experiments/benchmark.py --config=configs/benchmark.py \
      --config.methods=prompt_lookup,layer_skip,replay --config.prompt_limit=2
  python experiments/benchmark.py --config=configs/benchmark.py:sample --config.out=/tmp/b

Variants (the text after ':'), combinable with '+':
  sample  temperature 0.7, top-p 0.9
  bf16    bfloat16 weights and cache

Any JSONL file in Spec-Bench's format works (--config.prompts=...). A run
resumes from `out`/log.jsonl; change `out` when changing the settings.
"""

import importlib.util
import os

import ml_collections

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_BENCH = os.path.normpath(os.path.join(_REPO, os.pardir, "shared", "data", "spec_bench",
                                           "question_excl_mtbench.jsonl"))


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtype = "float32"
  # decode forwards bit for bit independent of the block (specjax.models.invariant):
  # greedy speculative output equals greedy AR token for token; slower
  c.batch_invariant = False
  c.prompts = SPEC_BENCH
  c.methods = "prompt_lookup,layer_skip"  # comma-separated drafters; AR is always run
  c.prompt_limit = ml_collections.config_dict.placeholder(int)  # per category; None: all
  c.max_new_tokens = 128
  c.batch_size = 1  # consecutive questions of one category decoded together
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.repeats = 3  # timed runs per method and question, interleaved with AR
  c.out = "/tmp/specjax_benchmark"
  # several processes of one JAX job on this machine share the units
  # (loopback, gloo); each decodes on its own local_devices (0: JAX's default)
  c.processes = 1
  c.local_devices = 0
  c.calibrate = True  # measure forward / drafter costs for the predicted-speedup column
  # Drafter settings (specjax.drafters.registry; None: the method's default).
  common.drafter_fields(c)
  common.apply_variants(c, arg, "configs/benchmark.py")
  c.lock()
  return c
