"""Fuzz the parsers for a while: malformed inputs must raise specjax's errors.

  python experiments/fuzz.py --config=configs/fuzz.py --config.seconds=300

Prints inputs tried per kind, how many loaded, were rejected with the clear
error, and crashed (must be 0), the time, the slowest input and the peak RSS
growth; exits with status 1 on any crash.
"""

import json
import logging
import sys

from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

from specjax.testing import fuzz

_CONFIG = config_flags.DEFINE_config_file("config", "configs/fuzz.py", "Fuzzing configuration.")


def main(argv):
  del argv
  c = _CONFIG.value
  # orbax logs every restore (and, from its own threads, every damaged one it refused)
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  report = fuzz.run(c.seconds, seed=c.seed, kinds=tuple(k for k in c.kinds.split(",") if k),
                    time_limit_s=c.time_limit_s, log=lambda line: print(line, flush=True))
  print(fuzz.format_report(report))
  if c.out:
    with open(c.out, "w", encoding="utf-8") as f:
      json.dump({"config": c.to_dict(), **report}, f, indent=1)
    print(f"wrote {c.out}")
  if report["crashes"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
