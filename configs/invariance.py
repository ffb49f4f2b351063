"""Batch-invariant decoding: its cost (AR tok/s and t_verify(k + 1), both modes
interleaved) and greedy speculative == greedy AR token for token with it on
(specjax.benchmarks.invariance).

  python experiments/invariance.py --config=configs/invariance.py --config.out=/tmp/inv
  python experiments/invariance.py --config=configs/invariance.py:quick   # cost, seconds
  python experiments/invariance.py --config=configs/invariance.py --config.parts=cost \
      --config.tiles=0,5,20   # the invariant forward at several rows per tile
  python experiments/invariance.py --config=configs/invariance.py --config.parts=cost \
      --config.verify_contexts=128,512,1280   # B = 1 verify timings after L context tokens
  python experiments/invariance.py --config=configs/invariance.py --config.parts=bitwise \
      --config.tiles=0,5,20   # SmolLM2's verify blocks vs one-token steps, bit for bit
  python experiments/invariance.py --config=configs/invariance.py:small   # identity, 1 question per category
  python experiments/invariance.py --config=configs/invariance.py --config.parts=speedup \
      --config.dtypes=float32 --config.tiles=0,5   # the best method's speedup, the setting off and on
  python experiments/invariance.py --config=configs/invariance.py --config.parts=report \
      --config.modes=on --config.out=/work/inv_identity   # the table of what a (partial) run logged
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import invariance

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.invariance.InvarianceSettings
  # (model, dtypes, parts (cost, identity, report, bitwise, speedup); cost, bitwise and
  # speedup: tiles; speedup: speedup_methods, speedup_method_dtypes, speedup_limit,
  # speedup_tokens; cost: prompt, max_new_tokens, repeats, verify_calls, verify_batches; identity:
  # prompts (Spec-Bench), prompt_limit, batch_size, modes, identity_tile, methods; out),
  # and the drafters' (k: the draft length and the verify block).
  common.settings_fields(c, invariance.InvarianceSettings)
  if arg == "quick":
    c.parts, c.repeats, c.verify_calls, c.max_new_tokens = "cost", 1, 3, 8
    c.verify_contexts = ""
  elif arg == "small":  # identity on one question per category, 32 tokens
    c.parts, c.prompt_limit, c.batch_size, c.max_new_tokens = "identity", 1, 1, 32
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/invariance.py (known: quick, small)")
  c.lock()
  return c
