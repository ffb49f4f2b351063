"""A data-scaling curve for EAGLE-3 on SmolLM2 (resumable).

  python experiments/scaling.py --config=configs/scaling.py \
      --config.data_path=/path/distill.jsonl --config.out=/tmp/scaling

Writes `out`/points.jsonl (one line per trained and measured point),
scaling.md (table + log-linear fit) and scaling.png.
"""

import importlib.util
import os

from absl import app
from ml_collections import config_flags

import specjax
from specjax.benchmarks import scaling
from specjax.training.settings import TrainSettings

_CONFIG = config_flags.DEFINE_config_file("config", "configs/scaling.py", "Scaling config.")


def _recipe(variant: str) -> TrainSettings:
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "eagle3.py")
  spec = importlib.util.spec_from_file_location("specjax_eagle3_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return TrainSettings.of(module.get_config(variant or None))


def main(argv):
  del argv
  c = _CONFIG.value
  specjax.use_compilation_cache()
  out = scaling.run_scaling(scaling.ScalingSettings.of(c), _recipe(c.recipe))
  print(out["markdown"])


if __name__ == "__main__":
  app.run(main)
