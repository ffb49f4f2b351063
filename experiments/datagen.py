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
  settings = datagen.DatagenSettings.of(_CONFIG.value)  # the ConfigDict, read once
  out = datagen.run(settings)
  print(out["markdown"])
  if settings.out:
    os.makedirs(settings.out, exist_ok=True)
    with open(os.path.join(settings.out, "results.json"), "w") as f:
      json.dump({"config": settings.flat(), "rows": out["rows"]}, f, indent=1)
    with open(os.path.join(settings.out, "results.md"), "w") as f:
      f.write(out["markdown"] + "\n")


if __name__ == "__main__":
  app.run(main)
