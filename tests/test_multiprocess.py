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

import compile_effort

pytestmark = pytest.mark.slow  # multi-process jobs (~4 min of start-ups and compiles)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 900


def _run_job(out_dir):
  port = distributed.free_port()
  # each worker forces its own device count
  env = distributed.child_env([os.path.dirname(os.path.dirname(WORKER))])
  env = compile_effort.unoptimized_env(env)  # tiny programs: compile-bound
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


def test_data_parallel_eagle_steps_on_gathered_loss_positions(job):
  """The gathered loss positions index the global batch: replicated, not split
  (their length here is one 8 devices do not divide), the data-parallel steps
  equal one device's on the whole batch."""
  for r in job:
    e = r["eagle"]
    assert e["gathered"]
    assert e["max_param_diff"] < 1e-5, e
    assert e["dp_losses"] == pytest.approx(e["ref_losses"], rel=1e-5, abs=1e-6)


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


# --- the experiments themselves, with --config.processes=2 ---------------------------

REPO = os.path.dirname(os.path.dirname(WORKER))


def _experiment(script, *flags, env=None, timeout=TIMEOUT_S):
  """python experiments/<script> <flags> -> (returncode, stdout + stderr)."""
  # tiny programs: compile-bound
  full_env = compile_effort.unoptimized_env(distributed.child_env([REPO]))
  full_env.update(env or {})
  p = subprocess.run([sys.executable, os.path.join(REPO, "experiments", script), *flags],
                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     timeout=timeout, cwd=REPO)
  return p.returncode, p.stdout


TRAIN_FLAGS = ("--config=configs/draft_model.py:tiny", "--config.steps=20",
               "--config.save_every=5", "--config.eval_every=10")


def test_train_experiment_data_parallel_two_processes_kill_and_resume(tmp_path):
  """experiments/train.py --config.processes=2 --config.local_devices=2: one job
  of 2 processes x 2 devices trains the tiny draft model data-parallel. A
  SIGKILL of process 0 at step 13 ends the job (the launcher kills the other
  process and fails); the same command resumes from process 0's step-10
  checkpoint and finishes with the parameters of a one-process run."""
  from specjax.training import loop  # pylint: disable=import-outside-toplevel
  dp = str(tmp_path / "dp")
  flags = (*TRAIN_FLAGS, "--config.processes=2", "--config.local_devices=2",
           f"--config.workdir={dp}")
  rc, log = _experiment("train.py", *flags, env={"SPECJAX_FAULT_AT": "step@13"})
  assert rc != 0, log  # killed
  steps = sorted(int(s) for s in os.listdir(os.path.join(dp, "state")) if s.isdigit())
  assert steps and steps[-1] == 10, steps
  rc, log = _experiment("train.py", *flags)
  assert rc == 0, log[-4000:]
  assert "resumed from step 10" in log, log[-4000:]
  assert os.path.exists(os.path.join(dp, "process_1.log"))  # the second process's output
  one = str(tmp_path / "one")
  rc, log1 = _experiment("train.py", *TRAIN_FLAGS, f"--config.workdir={one}")
  assert rc == 0, log1[-4000:]
  got, step = loop.latest_params(dp)
  want, step1 = loop.latest_params(one)
  assert step == step1 == 20
  diffs = [float(abs(a - b).max()) for a, b in zip(_leaves(got), _leaves(want))]
  assert max(diffs) < 1e-5, diffs
  # the metrics log has each logged step once (written by process 0 only)
  steps_logged = [json.loads(line)["step"] for line in open(os.path.join(dp, "metrics.jsonl"))]
  assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == 20, steps_logged


def _leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


BENCH_QUESTIONS = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in enumerate([
    ("copy", "Name a color."), ("copy", "Name a fruit."), ("count", "Count to three."),
    ("count", "Count to four.")])]


def test_benchmark_experiment_two_processes_equals_one(tmp_path, tiny_gguf):
  """experiments/benchmark.py --config.processes=2: the two processes share the
  units (each logs its own part; process 0 merges and writes the results);
  the merged log holds every unit once, with the outputs of a one-process run."""
  prompts = tmp_path / "q.jsonl"
  prompts.write_text("".join(json.dumps(q) + "\n" for q in BENCH_QUESTIONS))
  flags = ("--config=configs/benchmark.py", f"--config.model={tiny_gguf.path}",
           f"--config.prompts={prompts}", "--config.methods=prompt_lookup@k=2",
           "--config.max_new_tokens=6", "--config.repeats=1", "--config.calibrate=False")
  runs = {}
  for n in (2, 1):
    out = str(tmp_path / f"p{n}")
    rc, log = _experiment("benchmark.py", *flags, f"--config.processes={n}",
                          f"--config.out={out}")
    assert rc == 0, log[-4000:]
    with open(os.path.join(out, "log.jsonl")) as f:
      runs[n] = [json.loads(line) for line in f]
    assert os.path.exists(os.path.join(out, "results.json"))
    assert not [p for p in os.listdir(out) if p.startswith("log.process")]  # merged
  assert len(runs[2]) == len(runs[1]) == 2 * len(BENCH_QUESTIONS)  # AR + method per unit
  key = lambda r: (r["unit"], r["method"])  # noqa: E731
  assert sorted(map(key, runs[2])) == sorted(map(key, runs[1]))
  tokens = lambda rs: {key(r): r["tokens"] for r in rs}  # noqa: E731
  assert tokens(runs[2]) == tokens(runs[1])
  # both processes decoded: the second process's log names units it ran
  assert "q" in open(tmp_path / "p2" / "process_1.log").read()
