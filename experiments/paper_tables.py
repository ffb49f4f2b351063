"""The papers' tables measured on this machine: alpha (Leviathan et al. Table
3's form), the draft-length sweep against Theorem 3.8, the batch-size sweep,
the expected-tokens curve. Each writes markdown + JSON + PNG under
`out/<table>/`; the runs behind them resume where they stopped.

  python experiments/paper_tables.py --config=configs/paper_tables.py \
      --config.tables=gamma,expected --config.methods=draft_model,eagle3
"""

import sys

from absl import app
from ml_collections import config_flags

import specjax
from specjax import distributed
from specjax.benchmarks import paper_tables, specbench

_CONFIG = config_flags.DEFINE_config_file("config", "configs/paper_tables.py",
                                          "Run configuration.")


def main(argv):
  del argv
  # --config.processes=N: N processes of one JAX job share the units (this
  # command starts them; process 0 writes the results, the others log to
  # out/process_<i>.log)
  settings = paper_tables.PaperTablesSettings.of(_CONFIG.value)  # the ConfigDict, read once
  specbench.check_counts(settings)  # refused here, before a job's processes start
  status = distributed.run_as_job(settings.processes, settings.local_devices,
                                  log_dir=settings.out)
  if status is not None:
    sys.exit(status)
  specjax.use_compilation_cache()
  out = paper_tables.run(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
  for name, table in out.items():
    if distributed.is_primary():
      print(f"## {name}\n\n{table['markdown']}")


if __name__ == "__main__":
  app.run(main)
