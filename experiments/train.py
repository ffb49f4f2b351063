"""Train a drafter for the target: data, features, optax loop, orbax checkpoints.

  python experiments/train.py --config=configs/medusa.py
  python experiments/train.py --config=configs/medusa.py:tiny --config.workdir=/tmp/t
"""

import json

from absl import app
from absl import logging
from ml_collections import config_flags

import specjax
from specjax.training import run

_CONFIG = config_flags.DEFINE_config_file("config", "configs/medusa.py", "Training config.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # A killed run restarts with the same command: keep its compiles, so a
  # resume costs the restore, not the first step's compile again (jax's
  # default threshold, 1 s of compile time, or JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS).
  specjax.use_compilation_cache()
  out = run.run(_CONFIG.value)
  print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
  app.run(main)
