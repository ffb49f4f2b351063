"""Fuzzing the parsers (experiments/fuzz.py): how long, which input kinds.

  python experiments/fuzz.py --config=configs/fuzz.py --config.seconds=300
  python experiments/fuzz.py --config=configs/fuzz.py:quick   # 30 s
"""

import ml_collections

from specjax.testing import fuzz


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seconds = 300.0  # wall-clock budget of the mutate-and-load loop (setup excluded)
  c.seed = 0
  c.kinds = ",".join(fuzz.KINDS)  # comma-separated subset of fuzz.KINDS
  c.time_limit_s = 30.0  # one input running longer than this counts as a crash (hang)
  c.out = ""  # write the report as JSON here
  if arg == "quick":
    c.seconds = 30.0
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of fuzz.py (quick)")
  return c
