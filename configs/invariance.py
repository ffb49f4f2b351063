"""Batch-invariant decoding: its cost (AR tok/s and t_verify(k + 1), both modes
interleaved) and greedy speculative == greedy AR token for token with it on
(specjax.benchmarks.invariance).

  python experiments/invariance.py --config=configs/invariance.py --config.out=/tmp/inv
  python experiments/invariance.py --config=configs/invariance.py:quick   # cost, seconds
  python experiments/invariance.py --config=configs/invariance.py:small   # identity, 1 question per category
  python experiments/invariance.py --config=configs/invariance.py --config.parts=report \
      --config.modes=on --config.out=/work/inv_identity   # the table of what a (partial) run logged
"""

import importlib.util
import os

import ml_collections

_spec = importlib.util.spec_from_file_location(
    "benchmark_config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
SPEC_BENCH = _bench.SPEC_BENCH  # the Spec-Bench questions (without MT-Bench)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m"
  c.dtypes = "float32,bfloat16"
  c.parts = "cost,identity"  # or "report": the identity table from `out`/identity.jsonl, nothing run
  # cost
  c.prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."
  c.max_new_tokens = 64
  c.k = 4
  c.repeats = 4
  c.verify_calls = 20
  c.verify_batches = "1,4"  # t_verify(k + 1) at these batch sizes
  # identity: every drafter, chains and trees, on the headline prompt set
  c.prompts = SPEC_BENCH
  c.prompt_limit = 10  # the first N questions of each category
  c.batch_size = 10
  c.modes = "on,off"  # batch_invariant on (the claim), off (what the default forward does)
  c.methods = ("prompt_lookup,layer_skip,draft_model,medusa,blockwise,eagle,eagle3,lookahead,"
               "replay,medusa_tree,eagle_tree,eagle3_tree,lookahead_tree")
  c.out = ""
  if arg == "quick":
    c.parts, c.repeats, c.verify_calls, c.max_new_tokens = "cost", 1, 3, 8
  elif arg == "small":  # identity on one question per category, 32 tokens
    c.parts, c.prompt_limit, c.batch_size, c.max_new_tokens = "identity", 1, 1, 32
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/invariance.py (known: quick, small)")
  c.lock()
  return c
