"""Fault tolerance: training killed with SIGKILL resumes to the same bits.

`experiments/train.py` on the tiny draft-model config (a random 2-layer
target; 30 steps, a training-state checkpoint every 5, keep-best every 10) is
killed at seeded points -- inside a checkpoint save before its commit, inside
a keep-best save, between saves, right after a commit, and at a random
wall-clock time -- and restarted with the same command each time until it
finishes. Its final training state (parameters, optimizer state, step, key,
data position), keep-best parameters and per-step metrics must equal an
uninterrupted run's bit for bit. Negative controls: a resume with another
seed is refused, and a resume with a learning rate 3% off ends with other
bits (the comparison can fail). The kill points survived are printed (-s).

Plus, in-process: only complete, matching checkpoints are restored, and the
JSONL logs (training metrics, distillation data, the benchmark's log) survive
a last line cut short by a kill.
"""

import json
import os
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from specjax.benchmarks import specbench
from specjax.errors import MalformedFileError
from specjax.io import jsonl
from specjax.training import loop, state_store
from specjax.io.checkpoints import CheckpointError

import compile_effort

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY, EVAL_EVERY = 30, 5, 10
TRAIN = [sys.executable, "experiments/train.py", "--config=configs/draft_model.py:tiny",
         f"--config.steps={STEPS}", f"--config.save_every={SAVE_EVERY}",
         f"--config.eval_every={EVAL_EVERY}", "--config.log_every=1"]
SEED = 20261130  # the kill schedule's


def _env(fault=None):
  env = compile_effort.unoptimized_env(  # tiny programs: compile-bound
      dict(os.environ, JAX_PLATFORMS="cpu",
           # every compile of the tiny run is short: cache them all, so a
           # restart costs its start-up, not its compiles
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
  env.setdefault("SPECJAX_JAX_CACHE",
                 os.path.join(os.path.expanduser("~"), ".cache", "specjax", "xla"))
  env.pop(state_store.FAULT_ENV, None)
  if fault:
    env[state_store.FAULT_ENV] = fault
  return env


def _start(workdir, fault=None, extra=()):
  return subprocess.Popen(TRAIN + [f"--config.workdir={workdir}", *extra], cwd=REPO,
                          env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _finish(proc, kill_after_s=None, timeout=300):
  """Drain the run's output to its end; with kill_after_s, SIGKILL it that
  long after its first training step. -> (return code, output lines)."""
  lines, timer = [], None
  watchdog = threading.Timer(timeout, proc.kill)
  watchdog.start()
  try:
    for line in proc.stdout:
      lines.append(line.rstrip("\n"))
      if kill_after_s is not None and timer is None and line.startswith("step "):
        timer = threading.Timer(kill_after_s, proc.kill)
        timer.start()
    rc = proc.wait()
  finally:
    watchdog.cancel()
    if timer is not None:
      timer.cancel()
  return rc, lines


def _state_steps(workdir):
  d = os.path.join(workdir, "state")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _resume_point(workdir):
  steps = [s for s in _state_steps(workdir)
           if os.path.exists(os.path.join(workdir, "state", str(s), "commit_success.txt"))]
  return steps[-1] if steps else 0


def _last(lines, prefix):
  hits = [l for l in lines if l.startswith(prefix)]
  return hits[-1] if hits else None


def _same_bits(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  return all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
             for (_, x), (_, y) in zip(la, lb))


def _final(workdir):
  store = state_store.StateStore(os.path.join(workdir, "state"), read_only=True)
  state = store.restore(STEPS)
  store.close()
  best, best_step = loop.best_params(workdir, state["params"])
  hist = [{k: v for k, v in h.items() if k not in ("positions_per_s", "elapsed_s")}
          for h in jsonl.read(os.path.join(workdir, "metrics.jsonl"))]
  return state, jax.tree.map(np.asarray, best), best_step, hist


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("fault")
  rng = np.random.default_rng(SEED)
  ref_proc = _start(root / "reference")  # runs beside the killed one
  ref_out = {}
  ref_thread = threading.Thread(target=lambda: ref_out.update(r=_finish(ref_proc)))
  ref_thread.start()

  work = str(root / "killed")
  survived = []

  def launch(point, fault=None, kill_after_s=None):
    before = _resume_point(work)
    rc, lines = _finish(_start(work, fault), kill_after_s)
    rec = {"point": point, "resumed_from": before, "returncode": rc,
           "last_step_printed": _last(lines, "step "), "last_line": lines[-1] if lines else "",
           "checkpoints_left": sorted(os.listdir(os.path.join(work, "state")))}
    survived.append(rec)
    return rc, lines

  # 1. inside a state save: the step's files written, not committed
  s1 = int(rng.choice([10, 15, 20]))
  rc, _ = launch(f"state:before_commit@{s1}", f"state:before_commit@{s1}")
  assert rc == -9, survived[-1]
  assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(os.path.join(work, "state")))
  # negative-control workdirs: this killed run resumed with other settings
  for name in ("other_seed", "other_lr"):
    shutil.copytree(work, root / name)
  # 2. inside a keep-best save
  r = _resume_point(work)
  e = min(s for s in range(EVAL_EVERY, STEPS, EVAL_EVERY) if s > r)
  rc, _ = launch(f"best:before_commit@{e}", f"best:before_commit@{e}")
  assert rc == -9, survived[-1]
  # 3. between two saves (the steps since the last checkpoint are lost)
  r = _resume_point(work)
  k = r + int(rng.integers(1, SAVE_EVERY))
  rc, _ = launch(f"step@{k}", f"step@{k}")
  assert rc == -9, survived[-1]
  # ... and the metrics log's last line cut short, as a kill mid-append leaves it
  with open(os.path.join(work, "metrics.jsonl"), "a") as f:
    f.write('{"step": %d, "kl": 0.4' % (k + 1))
  # 4. right after a commit, before older checkpoints are retired
  r = _resume_point(work)
  s4 = r + SAVE_EVERY
  rc, _ = launch(f"state:after_commit@{s4}", f"state:after_commit@{s4}")
  assert rc == -9, survived[-1]
  # 5. at a random wall-clock time after the first step it prints
  delay = float(rng.uniform(0.0, 1.5))
  rc, _ = launch(f"wall-clock {delay:.2f}s after the first step", kill_after_s=delay)
  # then the same command until it finishes
  for _ in range(3):
    if rc == 0:
      break
    rc, lines = launch("none (run to the end)")
  assert rc == 0, "\n".join(lines[-30:])

  ref_thread.join()
  ref_rc, ref_lines = ref_out["r"]
  assert ref_rc == 0, "\n".join(ref_lines[-30:])
  print("\nkill points survived:\n" + "\n".join(json.dumps(s) for s in survived))
  return root, survived


@pytest.mark.slow  # training runs killed and resumed in subprocesses
def test_killed_runs_end_with_the_uninterrupted_runs_bits(runs):
  root, survived = runs
  assert sum(s["returncode"] == -9 for s in survived) >= 4
  ref, ref_best, ref_best_step, ref_hist = _final(str(root / "reference"))
  got, best, best_step, hist = _final(str(root / "killed"))
  assert int(got["step"]) == STEPS and int(got["data"]["next_step"]) == STEPS + 1
  assert _same_bits(got, ref)  # params, optimizer state, step, key, data position
  assert best_step == ref_best_step and _same_bits(best, ref_best)
  assert hist == ref_hist  # every step's loss, and every eval, with no line lost or doubled
  assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
  # no temporary, retired or extra checkpoints left behind
  assert sorted(os.listdir(os.path.join(root, "killed", "state"))) == ["25", "30"]


@pytest.mark.slow  # training runs killed and resumed in subprocesses
def test_negative_controls_resume_with_other_settings(runs):
  root, _ = runs
  seed_proc = _start(root / "other_seed", extra=["--config.seed=1"])
  lr_proc = _start(root / "other_lr", extra=["--config.lr=0.00309"])
  rc, lines = _finish(seed_proc)
  assert rc != 0 and "another seed" in "\n".join(lines[-20:]), "\n".join(lines[-20:])
  rc, lines = _finish(lr_proc)
  assert rc == 0, "\n".join(lines[-30:])
  ref = _final(str(root / "reference"))[0]
  other = _final(str(root / "other_lr"))[0]
  assert not _same_bits(other["params"], ref["params"])
  # close, though: the comparison tells apart runs that a tolerance would not
  for x, y in zip(jax.tree.leaves(other["params"]), jax.tree.leaves(ref["params"])):
    np.testing.assert_allclose(x, y, atol=0.05)


# --- in-process: the checkpoint store and the logs --------------------------------------


def _tree(scale=1.0):
  return {"w": np.full((2, 3), scale, np.float32), "layers": [np.arange(4, dtype=np.int32)],
          "step": np.asarray(1, np.int32)}


def test_store_restores_only_complete_matching_checkpoints(tmp_path):
  d = tmp_path / "state"
  store = state_store.StateStore(str(d), max_to_keep=3)
  store.save(1, _tree(1.0))
  store.save(2, _tree(2.0))
  store.close()
  # what a kill mid-save leaves: the step's files in a temporary directory
  shutil.copytree(d / "2", d / "3.orbax-checkpoint-tmp")
  os.remove(d / "3.orbax-checkpoint-tmp" / "commit_success.txt")
  # ... and a step directory that lost its commit marker
  shutil.copytree(d / "2", d / "4")
  os.remove(d / "4" / "commit_success.txt")
  store = state_store.StateStore(str(d), max_to_keep=3)
  assert not (d / "3.orbax-checkpoint-tmp").exists()  # cleaned on open
  assert store.steps() == [1, 2]
  step, tree = store.restore_latest(_tree())
  assert step == 2 and _same_bits(jax.tree.map(np.asarray, tree), _tree(2.0))
  # a damaged newest step: reported, and the one before it restored
  for dirpath, _, files in os.walk(d / "2" / "default"):
    for f in files:
      if not f.startswith("_"):
        with open(os.path.join(dirpath, f), "wb") as fh:
          fh.write(b"garbage")
  notes = []
  step, tree = store.restore_latest(_tree(), notes.append)
  assert step == 1 and _same_bits(jax.tree.map(np.asarray, tree), _tree(1.0))
  assert notes and "damaged" in notes[0]
  # another tree: an error naming the leaves, never a cast or a reshape
  for like, match in (({**_tree(), "w": np.zeros((3, 2), np.float32)}, r"w is float32\[2, 3\], "
                       r"expected float32\[3, 2\]"),
                      ({**_tree(), "w": np.zeros((2, 3), np.float16)}, "expected float16"),
                      ({**_tree(), "extra": np.zeros(1)}, "extra is missing"),
                      ({"w": _tree()["w"], "step": _tree()["step"]}, "layers/0 is not expected")):
    with pytest.raises(CheckpointError, match=match):
      store.restore(1, like)
  store.close()


def test_store_retires_what_a_kill_after_a_commit_left(tmp_path):
  # a kill after step 3's commit, before orbax retired step 1, leaves three
  # steps of a keep-two store; with no later save nothing else retires it
  d = tmp_path / "state"
  store = state_store.StateStore(str(d), max_to_keep=3)
  for s in (1, 2, 3):
    store.save(s, _tree(float(s)))
  store.close()
  store = state_store.StateStore(str(d), max_to_keep=2)
  assert store.steps() == [2, 3] and sorted(os.listdir(d)) == ["2", "3"]
  store.close()
  # keep-best: the best one stays, whatever its age
  b = tmp_path / "best"
  store = state_store.StateStore(str(b), max_to_keep=4, best_metric="tau")
  for s, tau in ((1, 1.5), (2, 2.0), (3, 1.0), (4, 2.0)):
    store.save(s, _tree(float(s)), metrics={"tau": tau})
  store.close()
  store = state_store.StateStore(str(b), max_to_keep=1, best_metric="tau")
  assert store.steps() == [1, 2, 3, 4]  # opening a keep-best store retires nothing ...
  store.delete_after(3)  # ... its resume does: step 4 is redone, then the best of the rest
  assert store.steps() == [2] and store.best_step() == 2
  store.close()


def test_jsonl_drops_a_last_line_cut_short(tmp_path):
  path = str(tmp_path / "log.jsonl")
  jsonl.append(path, [{"a": 1}, {"a": 2}])
  whole = open(path).read()
  with open(path, "a") as f:
    f.write('{"a": 3, "b": [1, 2')
  assert jsonl.read(path) == [{"a": 1}, {"a": 2}]
  assert open(path).read() == whole  # cut from the file: the next append is a whole line
  jsonl.append(path, [{"a": 3}])
  assert jsonl.read(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
  # a whole record whose newline was not written is kept
  with open(path, "a") as f:
    f.write('{"a": 4}')
  assert jsonl.read(path)[-1] == {"a": 4} and open(path).read().endswith('{"a": 4}\n')
  # damage before the last line is an error naming the line
  with open(path, "w") as f:
    f.write('{"a": 1}\n{"a": \n{"a": 3}\n')
  with pytest.raises(MalformedFileError, match=r"log.jsonl:2: malformed record"):
    jsonl.read(path)


def test_benchmark_log_resumes_after_a_kill_mid_append(tmp_path):
  """specbench's resume reads its log with `read_log`: a record cut short is
  not a finished (question, method), and the next append lands on its own line."""
  path = str(tmp_path / specbench.LOG)
  done = [{"unit": "2", "method": "ar", "settings": "x"},
          {"unit": "2", "method": "prompt_lookup", "settings": "x"}]
  jsonl.append(path, done)
  with open(path, "a") as f:
    f.write('{"unit": "3", "method": "ar", "sett')
  assert specbench.read_log(path) == done
  jsonl.append(path, [{"unit": "3", "method": "ar", "settings": "x"}])
  assert [(r["unit"], r["method"]) for r in specbench.read_log(path)] == [
      ("2", "ar"), ("2", "prompt_lookup"), ("3", "ar")]
