"""The papers' tables (specjax/benchmarks/paper_tables.py).

Usage:
  python experiments/paper_tables.py --config=configs/paper_tables.py \
      --config.tables=gamma --config.methods=draft_model,eagle3 --config.out=/tmp/tables
  python experiments/paper_tables.py --config=configs/paper_tables.py:bf16 --config.tables=batch

Every field of configs/benchmark.py applies (prompts, prompt_limit,
max_new_tokens, repeats, temperature, ...), plus the tables' own.
"""

import importlib.util
import os

import ml_collections

from specjax.benchmarks import paper_tables

_spec = importlib.util.spec_from_file_location(  # configs/common.py: what run configs share
    "specjax_configs_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # The run's fields, one default each: specjax.benchmarks.paper_tables.PaperTablesSettings,
  # i.e. every field of configs/benchmark.py (specbench.BenchmarkSettings; the tables'
  # own defaults for methods, prompt_limit, max_new_tokens, repeats and out) plus
  # tables, ks (gamma) and batch_sizes (batch), and the drafters' (None: the method's
  # default).
  common.settings_fields(c, paper_tables.PaperTablesSettings)
  common.apply_variants(c, arg, "configs/paper_tables.py")
  c.lock()
  return c
