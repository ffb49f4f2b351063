"""Export a distilled draft model (configs/draft_model.py) as an HF-format model.

  python experiments/export.py --config=configs/export.py --config.out=/tmp/smollm2-draft
"""

import json

from absl import app
from ml_collections import config_flags

from specjax.drafters import registry
from specjax.io.load import load_model
from specjax.training import draft_train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/export.py", "Export config.")


def main(argv):
  del argv
  c = _CONFIG.value
  if not c.out:
    raise app.UsageError("--config.out=<directory> is required")
  target = load_model(c.model)
  checkpoint = c.checkpoint or registry.shipped_checkpoint("draft_model")
  out = draft_train.export_hf(checkpoint, target, c.out, dtype=c.dtype or None,
                              overwrite=c.overwrite)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
