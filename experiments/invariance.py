"""Batch-invariant decoding: cost and token-for-token greedy identity.

  python experiments/invariance.py --config=configs/invariance.py --config.out=/tmp/inv
"""

import json
import os

from absl import app
from ml_collections import config_flags

from specjax.benchmarks import invariance

_CONFIG = config_flags.DEFINE_config_file("config", "configs/invariance.py", "Run configuration.")


def main(argv):
  del argv
  settings = invariance.InvarianceSettings.of(_CONFIG.value)  # the ConfigDict, read once
  out = invariance.run(settings)
  print(out["markdown"])
  if settings.out:
    os.makedirs(settings.out, exist_ok=True)
    with open(os.path.join(settings.out, "results.json"), "w") as f:
      json.dump({"config": settings.flat(), "cost": out["cost"], "identity": out["identity"],
                 "bitwise": out["bitwise"], "speedup": out["speedup"]}, f, indent=1)
    with open(os.path.join(settings.out, "results.md"), "w") as f:
      f.write(out["markdown"])


if __name__ == "__main__":
  app.run(main)
