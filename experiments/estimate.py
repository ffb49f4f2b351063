"""Teacher-forced acceptance estimates of trained drafters, side by side.

The estimate a training run keeps its best checkpoint by (a k-token greedy
chain's tau, top-1 agreement, T = 1 overlap alpha), for any exported
checkpoints of the config's method, on the validation records of the run the
config describes -- so checkpoints trained on different data compare on one
set, without a decoding benchmark:

  python experiments/estimate.py --config=configs/draft_model.py:distill \
      --config.data_path=/tmp/distill_full.jsonl \
      --checkpoints=specjax/checkpoints/smollm2-135m/draft_model,/tmp/new_draft_model \
      --skip_records=352

--skip_records=N leaves out the validation records among the data file's
first N (records an older checkpoint may have trained on). Prints one JSON
line per checkpoint; --out writes them to a file.
"""

import json

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from specjax.training.settings import TrainSettings

_CONFIG = config_flags.DEFINE_config_file("config", "configs/medusa.py", "Training config.")
_CHECKPOINTS = flags.DEFINE_list("checkpoints", [], "Exported checkpoint directories.")
_SKIP = flags.DEFINE_integer("skip_records", 0, "Leave out validation records among the data "
                             "file's first N records.")
_OUT = flags.DEFINE_string("out", "", "Write the estimates (JSON lines) here too.")


def main(argv):
  del argv
  if not _CHECKPOINTS.value:
    raise app.UsageError("--checkpoints: one or more exported checkpoint directories")
  from specjax.training import run  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.WARNING)
  settings = TrainSettings.of(_CONFIG.value)
  rows = []
  for path, est in run.estimate_checkpoints(settings, _CHECKPOINTS.value,
                                            skip_records=_SKIP.value):
    rows.append({"checkpoint": path, "method": settings.method, "skip_records": _SKIP.value,
                 "estimate": est})
    print(json.dumps(rows[-1]), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
  app.run(main)
