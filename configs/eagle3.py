"""Train an EAGLE-3 head on SmolLM2: fused low / middle / high target features,
no feature regression, the training-time test (3 unrolled steps).

  python experiments/train.py --config=configs/eagle3.py
  python experiments/train.py --config=configs/eagle3.py:reduced   # 8192-token draft vocab
  python experiments/train.py --config=configs/eagle3.py:tiny      # seconds, tests
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "specjax_eagle_config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "eagle.py"))
_eagle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_eagle)


def get_config(arg=None):
  return _eagle.get_config(arg, method="eagle3")
