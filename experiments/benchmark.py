"""Spec-Bench protocol: speedup of speculative methods over AR per category.

  python experiments/benchmark.py --config=configs/benchmark.py \
      --config.methods=prompt_lookup,layer_skip,replay --config.prompt_limit=2 \
      --config.out=/tmp/bench

Writes out/results.json, out/results.md, out/speedup.png and out/log.jsonl
(resumable); prints the markdown table.
"""

import sys

from absl import app
from ml_collections import config_flags

import specjax
from specjax import distributed
from specjax.benchmarks import specbench

_CONFIG = config_flags.DEFINE_config_file("config", "configs/benchmark.py", "Run configuration.")


def _progress(line: str) -> None:
  if sys.stderr.isatty():
    sys.stderr.write("\r\033[K" + line)
  else:
    sys.stderr.write(line + "\n")
  sys.stderr.flush()


def main(argv):
  del argv
  # --config.processes=N: N processes of one JAX job share the units (this
  # command starts them; process 0 writes the results, the others log to
  # out/process_<i>.log)
  settings = specbench.BenchmarkSettings.of(_CONFIG.value)  # the ConfigDict, read once
  specbench.check_counts(settings)  # refused here, before a job's processes start
  status = distributed.run_as_job(settings.processes, settings.local_devices,
                                  log_dir=settings.out)
  if status is not None:
    sys.exit(status)
  # Compiles (one per method and prompt bucket) cost ~30-60 s each on a 2-core
  # CPU: keep them across runs and resumes. Timed runs never include them.
  specjax.use_compilation_cache()
  out = specbench.run_benchmark(settings, progress=_progress)
  if sys.stderr.isatty():
    sys.stderr.write("\n")
  if distributed.is_primary():
    print(out["markdown"])


if __name__ == "__main__":
  app.run(main)
