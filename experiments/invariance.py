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
  c = _CONFIG.value
  out = invariance.run(c)
  print(out["markdown"])
  if c.out:
    os.makedirs(c.out, exist_ok=True)
    with open(os.path.join(c.out, "results.json"), "w") as f:
      json.dump({"config": c.to_dict(), "cost": out["cost"], "identity": out["identity"]}, f,
                indent=1)
    with open(os.path.join(c.out, "results.md"), "w") as f:
      f.write(out["markdown"])


if __name__ == "__main__":
  app.run(main)
