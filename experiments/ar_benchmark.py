"""Autoregressive decoding benchmark: specjax vs the memory roofline and HF transformers.

  python experiments/ar_benchmark.py --config=configs/ar_benchmark.py
  python experiments/ar_benchmark.py --config=configs/ar_benchmark.py:quick --config.out=ar.json
"""

import json

from absl import app
from ml_collections import config_flags

from specjax.benchmarks import ar

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ar_benchmark.py",
                                          "Benchmark configuration.")


def main(argv):
  del argv
  settings = ar.ARBenchmarkSettings.of(_CONFIG.value)  # the ConfigDict, read once
  out = ar.run_ar_benchmark(settings, log=lambda line: print(line, flush=True))
  print()
  print(ar.format_table(out))
  if settings.out:
    with open(settings.out, "w", encoding="utf-8") as f:
      json.dump({"config": settings.flat(), **out}, f, indent=1)
    print(f"wrote {settings.out}")


if __name__ == "__main__":
  app.run(main)
