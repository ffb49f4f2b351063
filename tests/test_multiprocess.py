"""Two processes with 4 CPU devices each, joined by `jax.distributed` over
loopback (gloo collectives): data-parallel drafter training reaches the
parameters of one process training on the whole batch, and a data-parallel
batch-size sweep returns the one-process outputs (tests/multiprocess_worker.py)."""

import json
import os
import subprocess
import sys
import time

import pytest

from specjax import distributed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 900


def _run_job(out_dir):
  port = distributed.free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each worker forces its own device count
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(os.path.dirname(WORKER)), env.get("PYTHONPATH", "")])
  procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(NUM_PROCESSES), str(port),
                             str(out_dir)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for i in range(NUM_PROCESSES)]
  deadline = time.monotonic() + TIMEOUT_S
  logs = [""] * NUM_PROCESSES
  try:
    for i, p in enumerate(procs):
      logs[i] = p.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
  except subprocess.TimeoutExpired:
    pytest.fail(f"the {NUM_PROCESSES}-process job did not finish in {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{logs[i][-4000:]}"
  return [json.load(open(os.path.join(out_dir, f"result_{i}.json")))
          for i in range(NUM_PROCESSES)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  return _run_job(tmp_path_factory.mktemp("multiprocess"))


def test_processes_see_one_job_of_eight_devices(job):
  for i, r in enumerate(job):
    assert (r["process_id"], r["process_count"], r["devices"], r["local_devices"]) == (i, 2, 8, 4)


def test_data_parallel_training_equals_one_process_on_the_global_batch(job):
  for r in job:
    t = r["train"]
    assert t["mesh"] == {"data": 8, "model": 1}
    assert t["max_param_update"] > 1e-3  # the steps did move the parameters
    assert t["max_param_diff"] < 1e-5, t
    assert t["dp_losses"] == pytest.approx(t["ref_losses"], rel=1e-5, abs=1e-6)
  # both processes hold the same replicated parameters
  assert job[0]["train"]["dp_losses"] == job[1]["train"]["dp_losses"]


def test_data_parallel_sweep_equals_one_process(job):
  for r in job:
    cases = {(s["method"], s["batch_size"], s["sampling"]) for s in r["sweep"]}
    assert cases == {(m, b, s) for m in ("ar", "prompt_lookup") for b in (2, 4)
                     for s in ("greedy", "sampled")}
    for s in r["sweep"]:
      assert s["diverged"] == 0, s
      if s["sampling"] == "sampled":
        assert s["status"] == "identical", s
  assert job[0]["sweep"] == job[1]["sweep"]
