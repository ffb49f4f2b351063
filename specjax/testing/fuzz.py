"""Fuzzing the parsers: every malformed input is a clear error, never a crash.

Small valid inputs of each kind are written once (`make_seeds`), then mutated:
truncated, bytes flipped, length / count / offset fields overwritten with huge
values, NaN / inf written into weights, JSON fields replaced by values of the
wrong type or range. Each mutant is loaded by the library's own entry point
and must either load and pass a sanity check (finite weights of the declared
shapes, questions of the right types) or raise the library's error for it:

  gguf         specjax.io.load.load_model on a .gguf file      -> MalformedFileError
  safetensors  specjax.io.hf.load_hf, model.safetensors mutated -> MalformedFileError
  hf_config    specjax.io.hf.load_hf, config.json mutated       -> MalformedFileError
  checkpoint   specjax.io.checkpoints.load_drafter        -> MalformedFileError
  prompts      specjax.benchmarks.questions.load_questions     -> MalformedFileError
  config       run settings -> SamplingConfig, SpecConfig and
               specjax.drafters.registry.make_drafter           -> BadInputError

Anything else -- another exception type, a sanity failure, an input that takes
longer than `time_limit_s` -- is a crash. Mutations draw their choices through
a `draw(lo, hi) -> int` callback, so the same mutators serve a seeded random
loop (`run`, behind experiments/fuzz.py) and hypothesis strategies (the test
suite), which can then shrink a failing input.

This module is the harness: loading a mutant, the sanity checks and the timed
loop. The seeds and the mutators live in specjax.testing.fuzz_inputs; the
names callers use (`make_seeds`, `KINDS`, `PROMPTS`, `write_tiny_gguf`, ...)
are re-exported here.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import shutil
import signal
import tempfile
import time
import traceback
from typing import Callable, Optional

import jax
import numpy as np

from specjax.errors import BadInputError, ConfigValueError, MalformedFileError
from specjax.testing.fuzz_inputs import (  # re-exported: callers use them as fuzz.<name>
    BOUNDARY_U64, JSON_VALUES, KINDS, NONFINITE_F32, PROMPTS, Draw, Seeds, _pick,
    gguf_fields, make_seeds, mutate_bytes, mutate_json, mutate_prompts,
    mutate_safetensors_header, safetensors_fields, tiny_drafter_params, tiny_vocab,
    write_tiny_gguf)

__all__ = [
    # the inputs (specjax.testing.fuzz_inputs)
    "BOUNDARY_U64", "JSON_VALUES", "KINDS", "NONFINITE_F32", "PROMPTS", "Draw", "Seeds",
    "gguf_fields", "make_seeds", "mutate_bytes", "mutate_json", "mutate_prompts",
    "mutate_safetensors_header", "safetensors_fields", "tiny_drafter_params", "tiny_vocab",
    "write_tiny_gguf",
    # the harness
    "InsaneResult", "CONFIG_FIELDS", "FUZZERS", "EXPECTED_ERROR", "fuzz_gguf",
    "fuzz_safetensors", "fuzz_hf_config", "fuzz_checkpoint", "fuzz_prompts", "fuzz_config",
    "try_one", "run", "format_report",
]


# ----------------------------------------------------------------------------
# Loading a mutant, with a sanity check of what loaded


class InsaneResult(AssertionError):
  """A mutant loaded without error but what came out is not sane."""


def _check_finite_params(params, where: str) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise InsaneResult(f"{where}: no parameters")
  for path, leaf in leaves:
    arr = np.asarray(leaf)
    if arr.dtype.kind in "fV" or arr.dtype.name == "bfloat16":
      if not np.isfinite(arr.astype(np.float32)).all():
        raise InsaneResult(f"{where}: {jax.tree_util.keystr(path)} has NaN / inf")


def _check_model(params, cfg, where: str) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  _check_finite_params(params, where)
  want = dict(hf.expected_shapes(cfg))
  got = {name: tuple(w.shape) for name, w in hf.to_hf_tensors(params, cfg)}
  if got != want:
    raise InsaneResult(f"{where}: loaded shapes {got} do not match the config {want}")


def _write(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)


def fuzz_gguf(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io.load import load_model  # pylint: disable=import-outside-toplevel

  with open(seeds.gguf, "rb") as f:
    data = f.read()
  mutant, name = mutate_bytes(data, draw, seeds.gguf_fields, seeds.gguf_floats)
  path = seeds.scratch("m.gguf")
  _write(path, mutant)
  note(name)
  model = load_model(path)
  _check_model(model.params, model.cfg, path)
  model.tokenizer.decode(model.tokenizer.encode("the cat"))


def _hf_mutant_dir(seeds: Seeds) -> str:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = seeds.scratch("hf")
  os.makedirs(out, exist_ok=True)
  for name in (hf.CONFIG_FILE, hf.WEIGHTS_FILE):
    shutil.copyfile(os.path.join(seeds.hf_dir, name), os.path.join(out, name))
  return out


def fuzz_safetensors(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = _hf_mutant_dir(seeds)
  file = os.path.join(out, hf.WEIGHTS_FILE)
  with open(file, "rb") as f:
    data = f.read()
  if draw(0, 2) == 0:
    mutant, name = mutate_safetensors_header(data, draw)
  else:
    mutant, name = mutate_bytes(data, draw, seeds.st_fields, seeds.st_floats)
  _write(file, mutant)
  note(name)
  params, cfg = hf.load_hf(out)
  _check_model(params, cfg, out)


def fuzz_hf_config(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import hf  # pylint: disable=import-outside-toplevel

  out = _hf_mutant_dir(seeds)
  file = os.path.join(out, hf.CONFIG_FILE)
  with open(file, "rb") as f:
    data = f.read()
  if draw(0, 3):
    obj, name = mutate_json(json.loads(data), draw)
    mutant = json.dumps(obj).encode()
  else:
    mutant, name = mutate_bytes(data, draw)
  _write(file, mutant)
  note(name)
  params, cfg = hf.load_hf(out)
  _check_model(params, cfg, out)


def fuzz_checkpoint(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.io import checkpoints  # pylint: disable=import-outside-toplevel

  out = seeds.scratch("ckpt")
  shutil.rmtree(out, ignore_errors=True)
  source = seeds.checkpoint_nan if draw(0, 7) == 0 else seeds.checkpoint
  shutil.copytree(source, out)
  files = sorted(os.path.relpath(os.path.join(d, f), out)
                 for d, _, fs in os.walk(out) for f in fs)
  op = draw(0, 5)
  if source == seeds.checkpoint_nan:
    name = "nan_weight"
  elif op == 0:
    victim = _pick(draw, files)
    os.remove(os.path.join(out, victim))
    name = "delete_file"
  elif op == 1:
    with open(os.path.join(out, checkpoints.CARD), encoding="utf-8") as f:
      card, name = mutate_json(json.load(f), draw)
    with open(os.path.join(out, checkpoints.CARD), "w", encoding="utf-8") as f:
      json.dump(card, f)
  else:
    victim = os.path.join(out, _pick(draw, files))
    with open(victim, "rb") as f:
      data = f.read()
    if not data:
      data = b"\x00"
    mutant, name = mutate_bytes(data, draw)
    _write(victim, mutant)
  note(name)
  params, card = checkpoints.load_drafter(out, method=None)
  if not isinstance(card, dict):
    raise InsaneResult(f"{out}: card is a {type(card).__name__}")
  _check_finite_params(params, out)


def fuzz_prompts(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax.benchmarks import questions as questions_lib  # pylint: disable=import-outside-toplevel

  with open(seeds.prompts, "rb") as f:
    data = f.read()
  mutant, name = mutate_prompts(data, draw)
  path = seeds.scratch("prompts.jsonl")
  _write(path, mutant)
  note(name)
  questions = questions_lib.load_questions(path)
  for q in questions:
    if not (isinstance(q.question_id, int) and isinstance(q.category, str) and q.turns
            and all(isinstance(t, str) for t in q.turns)):
      raise InsaneResult(f"{path}: loaded an ill-typed question {q}")


# Run settings of configs/*.py as make_drafter reads them, and values to try.
CONFIG_FIELDS = {
    "method": ["prompt_lookup", "layer_skip", "draft_model", "replay", "always_reject",
               "lookahead", "lookahead_tree", "medusa", "eagle_tree", "no_such_method",
               "prompt_lookup@k=2", "prompt_lookup@k=-1", "layer_skip@layers=9",
               "prompt_lookup@bogus=1", "prompt_lookup@", "@", "lookahead@window=0"],
    "k": [1, 2, 4, 0, -1, -5, 2.5, "3", None, True, 10 ** 9],
    "temperature": [0.0, 0.7, 1.0, -0.1, -1, float("nan"), float("inf"), "hot", None],
    "top_k": [0, 5, -1, 2.5, "x", None, 10 ** 12],
    "top_p": [1.0, 0.9, 0.0, -0.5, 1.5, float("nan"), "x", None],
    "max_ngram": [3, 1, 0, -2, "x", None],
    "min_ngram": [1, 0, 5, -1, None],
    "layers": ["0", "0-0", "every2", "", "5", "-1", "0-9", "a-b", None, 3],
    "draft_model": ["self:1", "self:0", "self:99", "self:x", "/no/such/dir", None],
    "checkpoint": ["/no/such/checkpoint", None],
    "draft_stop": [0.0, 0.5, -1.0, 2.0, float("nan"), "x", None],
    "tree_nodes": [16, 1, 0, -3, "x", None, [1]],
    "tree_mode": ["wor", "iid", "topk", "bogus", None, 1],
    "tree_topk": [4, 1, 0, -1, None],
    "tree_width": [4, 1, 0, 9, None],
    "window": [4, 0, -1, None],
    "ngram": [3, 1, 0, None],
    "max_candidates": [4, 0, None],
}


def fuzz_config(seeds: Seeds, draw: Draw, note: Callable[[str], None]) -> None:
  from specjax import sampling as sampling_lib  # pylint: disable=import-outside-toplevel
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel

  config = {name: _pick(draw, values) for name, values in CONFIG_FIELDS.items()
            if draw(0, 2)}
  config.setdefault("method", "prompt_lookup")
  note("settings")
  sampling = registry.sampling_of(config)
  spec = sp.SpecConfig(sampling=sampling)
  drafter, draft_params = registry.make_drafter(
      config["method"], config, seeds.target, sampling=sampling, reference=[[5, 6, 7]])
  drafter.check(seeds.target.cfg, draft_params)
  if not isinstance(spec.sampling, sampling_lib.SamplingConfig) or drafter.k < 1:
    raise InsaneResult(f"config {config} built k={drafter.k}")


FUZZERS = {"gguf": fuzz_gguf, "safetensors": fuzz_safetensors, "hf_config": fuzz_hf_config,
           "checkpoint": fuzz_checkpoint, "prompts": fuzz_prompts, "config": fuzz_config}
# The error every input of a kind must raise if it does not load.
EXPECTED_ERROR = {kind: MalformedFileError for kind in KINDS}
EXPECTED_ERROR["config"] = BadInputError


def try_one(kind: str, seeds: Seeds, draw: Draw) -> tuple:
  """Mutate and load one input -> (outcome, mutation, detail). outcome is
  'loaded', 'rejected' (the expected error) or 'crash' (anything else)."""
  seen = ["?"]
  try:
    FUZZERS[kind](seeds, draw, lambda name: seen.__setitem__(0, name))
    return "loaded", seen[0], ""
  except EXPECTED_ERROR[kind] as e:
    return "rejected", seen[0], str(e)[:300]
  except Exception as e:  # pylint: disable=broad-except
    return "crash", seen[0], "".join(traceback.format_exception(type(e), e, e.__traceback__))


# ----------------------------------------------------------------------------
# The timed random loop


class _Timeout(BaseException):
  """One input ran past its time limit (a BaseException: not caught as a crash)."""


@contextlib.contextmanager
def _time_limit(seconds: float):
  def handler(signum, frame):
    raise _Timeout()

  old = signal.signal(signal.SIGALRM, handler)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def run(seconds: float, seed: int = 0, kinds=KINDS, workdir: Optional[str] = None,
        time_limit_s: float = 30.0, log: Optional[Callable[[str], None]] = None) -> dict:
  """Fuzz the parsers round-robin over `kinds` for `seconds` -> report.

  report: per kind, inputs tried, how many loaded, were rejected with the
  expected error, crashed (another exception, a sanity failure, or past
  `time_limit_s`), by mutation; the first crashes with tracebacks; seconds,
  the slowest input, and the peak RSS growth (an unbounded allocation shows
  there).
  """
  unknown = sorted(set(kinds) - set(KINDS))
  if unknown or not kinds:
    raise ConfigValueError(f"fuzz kinds {unknown or '(none)'}: expected some of {list(KINDS)}")
  rng = np.random.default_rng(seed)

  def draw(lo, hi):
    return int(rng.integers(lo, hi + 1))

  own = workdir is None
  workdir = workdir or tempfile.mkdtemp(prefix="specjax-fuzz-")
  try:
    t0 = time.perf_counter()
    seeds = make_seeds(workdir)
    setup_s = time.perf_counter() - t0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts = {k: collections.Counter() for k in kinds}
    by_mutation = {k: collections.Counter() for k in kinds}
    crashes, slowest = [], (0.0, "", "")
    t0 = time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
      kind = kinds[i % len(kinds)]
      i += 1
      start = time.perf_counter()
      try:
        with _time_limit(time_limit_s):
          outcome, name, detail = try_one(kind, seeds, draw)
      except _Timeout:
        outcome, name, detail = "crash", "?", f"took longer than {time_limit_s} s (hang?)"
      took = time.perf_counter() - start
      if took > slowest[0]:
        slowest = (took, kind, name)
      counts[kind][outcome] += 1
      counts[kind]["tried"] += 1
      by_mutation[kind][f"{name}:{outcome}"] += 1
      if outcome == "crash":
        crashes.append({"kind": kind, "mutation": name, "detail": detail})
        if log:
          log(f"CRASH {kind} {name}: {detail}")
      if log and i % 1000 == 0:
        log(f"{i} inputs, {time.perf_counter() - t0:.0f} s")
    elapsed = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": elapsed,
        "setup_seconds": setup_s,
        "inputs": sum(c["tried"] for c in counts.values()),
        "crashes": sum(c["crash"] for c in counts.values()),
        "kinds": {k: {o: counts[k][o] for o in ("tried", "loaded", "rejected", "crash")}
                  for k in kinds},
        "mutations": {k: dict(sorted(by_mutation[k].items())) for k in kinds},
        "slowest_input_s": slowest[0],
        "slowest_input": f"{slowest[1]} {slowest[2]}",
        "peak_rss_growth_mb": (rss1 - rss0) / 1024.0,
        "crash_examples": crashes[:10],
        "seed": seed,
    }
  finally:
    if own:
      shutil.rmtree(workdir, ignore_errors=True)


def format_report(report: dict) -> str:
  lines = [f"fuzzed {report['inputs']} inputs in {report['seconds']:.0f} s "
           f"(setup {report['setup_seconds']:.1f} s), seed {report['seed']}: "
           f"{report['crashes']} crashes",
           f"{'kind':12s} {'tried':>7s} {'loaded':>7s} {'rejected':>9s} {'crash':>6s}"]
  for kind, c in report["kinds"].items():
    lines.append(f"{kind:12s} {c['tried']:7d} {c['loaded']:7d} {c['rejected']:9d} "
                 f"{c['crash']:6d}")
  lines.append(f"slowest input {report['slowest_input_s']:.2f} s ({report['slowest_input']}); "
               f"peak RSS growth {report['peak_rss_growth_mb']:.0f} MB")
  for c in report["crash_examples"]:
    last = c["detail"].strip().splitlines()[-1] if c["detail"].strip() else ""
    lines.append(f"--- crash: {c['kind']} {c['mutation']}: {last}")
  return "\n".join(lines)
