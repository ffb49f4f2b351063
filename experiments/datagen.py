"""Answer-generation throughput for drafter training data, ways side by side.

  python experiments/datagen.py --config=configs/datagen.py
"""

import json
import os

from absl import app
from ml_collections import config_flags

from specjax.benchmarks import datagen

_CONFIG = config_flags.DEFINE_config_file("config", "configs/datagen.py", "Run configuration.")


def main(argv):
  del argv
  c = _CONFIG.value
  out = datagen.run(c)
  print(out["markdown"])
  if c.out:
    os.makedirs(c.out, exist_ok=True)
    with open(os.path.join(c.out, "results.json"), "w") as f:
      json.dump({"config": c.to_dict(), "rows": out["rows"]}, f, indent=1)
    with open(os.path.join(c.out, "results.md"), "w") as f:
      f.write(out["markdown"] + "\n")


if __name__ == "__main__":
  app.run(main)
