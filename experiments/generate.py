"""Generate a chat answer and print decoding metrics.

  python experiments/generate.py --config=configs/smollm2.py --config.prompt="Hi!"
"""

import json

from absl import app
from ml_collections import config_flags

from specjax import runner

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py", "Run configuration.")


def main(argv):
  del argv
  out = runner.generate(runner.GenerateSettings.of(_CONFIG.value))
  print(out.pop("answer"))
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  app.run(main)
