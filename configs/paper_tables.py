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

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py")


def get_config(arg=None):
  spec = importlib.util.spec_from_file_location("benchmark_config", _BENCH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg)
  with c.unlocked():
    c.tables = "all"  # leviathan, specbench, gamma, batch, expected (comma-separated) or all
    c.methods = "draft_model,eagle3,prompt_lookup"
    c.prompt_limit = 1
    c.max_new_tokens = 96
    c.repeats = 2
    c.ks = "1,2,3,4,6,8"  # gamma: the draft lengths swept
    c.batch_sizes = "1,2,4,8,16,32"  # batch: B consecutive prompts of a category per unit
    c.out = "/tmp/specjax_tables"
  return c
