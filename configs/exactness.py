"""Exactness matrix: vet drafters x sampling settings x k x batch size.

  python experiments/exactness.py --config=configs/exactness.py
  python experiments/exactness.py --config=configs/exactness.py:quick
  python experiments/exactness.py --config=configs/exactness.py \
      --config.drafters=draft_model --config.ks=2 --config.num_samples=200000

Runs on a tiny target/draft pair with vocabulary 8 (the exact joint law of the
first tokens is enumerable there); prints chi-square p-value and TV per setting
with Holm's correction over the whole matrix.
"""

import importlib.util
import os

import ml_collections

from specjax.analysis import vetting

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The matrix's fields, one default each: specjax.analysis.vetting.MatrixSettings
  # (drafters, samplings, ks, batch_sizes, num_samples, num_tokens, seed,
  # family_alpha, out).
  common.settings_fields(c, vetting.MatrixSettings)
  if arg == "quick":
    c.drafters, c.samplings, c.ks, c.batch_sizes = "draft_model", "T1=1.0/0/1.0", "3", "1"
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/exactness.py (quick)")
  c.lock()
  return c
