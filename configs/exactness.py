"""Exactness matrix: vet drafters x sampling settings x k x batch size.

  python experiments/exactness.py --config=configs/exactness.py
  python experiments/exactness.py --config=configs/exactness.py:quick
  python experiments/exactness.py --config=configs/exactness.py \
      --config.drafters=draft_model --config.ks=2 --config.num_samples=200000

Runs on a tiny target/draft pair with vocabulary 8 (the exact joint law of the
first tokens is enumerable there); prints chi-square p-value and TV per setting
with Holm's correction over the whole matrix.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.drafters = "draft_model,layer_skip,prompt_lookup,lookahead"
  # name=temperature/top_k/top_p
  c.samplings = "T1=1.0/0/1.0,T0.7=0.7/0/1.0,topk=1.0/4/1.0,topp=1.0/0/0.9"
  c.ks = "1,3,5"
  c.batch_sizes = "1,4"
  c.num_samples = 100_000
  c.num_tokens = 4
  c.seed = 0
  c.family_alpha = 1e-3
  c.out = ""
  if arg == "quick":
    c.drafters, c.samplings, c.ks, c.batch_sizes = "draft_model", "T1=1.0/0/1.0", "3", "1"
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/exactness.py (quick)")
  c.lock()
  return c
