"""specjax side by side with HF transformers and llama.cpp on the same prompts.

  python experiments/peers.py --config=configs/peers.py
  python experiments/peers.py --config=configs/peers.py:quick --config.out=/tmp/peers_quick

Writes out/results.json, out/results.md and out/log.jsonl (resumable); prints
the markdown table.
"""

import sys

from absl import app
from ml_collections import config_flags

import specjax
from specjax.benchmarks import peers

_CONFIG = config_flags.DEFINE_config_file("config", "configs/peers.py", "Run configuration.")


def _progress(line: str) -> None:
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


def main(argv):
  del argv
  # Compiles are excluded from the timings; the cache only saves their wall time.
  specjax.use_compilation_cache()
  settings = peers.PeersSettings.of(_CONFIG.value)  # the ConfigDict, read once
  out = peers.run_peers(settings, progress=_progress)
  print(out["markdown"])


if __name__ == "__main__":
  app.run(main)
