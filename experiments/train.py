"""Train a drafter for the target: data, features, optax loop, orbax checkpoints.

  python experiments/train.py --config=configs/medusa.py
  python experiments/train.py --config=configs/medusa.py:tiny --config.workdir=/tmp/t

Data-parallel over several processes of one JAX job on this machine
(`jax.distributed` over loopback, gloo collectives): this command starts them
and waits; process 0 prints, the others log to <workdir>/process_<i>.log.

  python experiments/train.py --config=configs/draft_model.py:tiny \
      --config.processes=2 --config.local_devices=2
"""

import json
import sys

from absl import app
from absl import logging
from ml_collections import config_flags

import specjax
from specjax import distributed
from specjax.training.settings import TrainSettings

_CONFIG = config_flags.DEFINE_config_file("config", "configs/medusa.py", "Training config.")


def main(argv):
  del argv
  # the ConfigDict, read once; a job's other processes re-run this command line
  settings = TrainSettings.of(_CONFIG.value)
  settings.check()  # a field out of range: refused here, before a job's processes start
  status = distributed.run_as_job(settings.processes, settings.local_devices,
                                  log_dir=settings.workdir)  # before JAX starts a backend
  if status is not None:  # this was the launcher: the job has ended
    sys.exit(status)
  from specjax.training import run  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # A killed run restarts with the same command: keep its compiles, so a
  # resume costs the restore, not the first step's compile again (jax's
  # default threshold, 1 s of compile time, or JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS).
  specjax.use_compilation_cache()
  out = run.run(settings)
  if distributed.is_primary():
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
  app.run(main)
