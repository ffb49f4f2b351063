"""Vet drafters for exactness: the full matrix of the test suite's Monte-Carlo test.

  python experiments/exactness.py --config=configs/exactness.py[:quick]
"""

import json

from absl import app
from ml_collections import config_flags

from specjax.analysis import vetting

_CONFIG = config_flags.DEFINE_config_file("config", "configs/exactness.py", "Matrix to run.")


def main(argv):
  del argv
  settings = vetting.MatrixSettings.of(_CONFIG.value)  # the ConfigDict, read once
  rows = vetting.run_matrix(settings, log=print)
  if settings.out:
    with open(settings.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
