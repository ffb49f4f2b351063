"""Injected bugs the suite must catch: proof that making it faster lost no guarantee.

Each entry is a real bug of the kind speculative-decoding implementations ship,
written as one source substitution, with the test files whose semantic checks
should catch it. `python tests/injected_bugs.py` copies the repository to a
temporary directory once per bug, applies the substitution, runs those files
and lists every test that failed; a bug that no test catches is a lost
guarantee and makes the script exit non-zero. (The golden tokens catch every
one of them too, by design; they are left out so that each bug is shown caught
by a test that says what is wrong.)

  python tests/injected_bugs.py                     # every bug
  python tests/injected_bugs.py off_by_one_fill     # one bug
  python tests/injected_bugs.py --tests "-m 'not slow'"   # another selection
  python tests/injected_bugs.py --control           # the selections, unmutated: must pass
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Bug:
  name: str
  why: str  # what goes wrong
  path: str  # file, relative to the repository root
  old: str  # exact text replaced (must occur exactly once)
  new: str
  tests: str  # the pytest selection expected to catch it


BUGS = (
    Bug("key_reused_for_draft_and_accept",
        "the acceptance uniforms come from the key stream the drafter sampled with: "
        "acceptance is correlated with the guess (biased output)",
        "specjax/decoding/speculative.py",
        "accept_keys = batch_lib.purpose_keys(state.keys, spec.accept_purpose, state.round)",
        "accept_keys = batch_lib.purpose_keys(state.keys, batch_lib.DRAFT, state.round)",
        "tests/test_exactness_montecarlo.py"),
    Bug("dropped_bonus_token",
        "a round that accepts every guess emits no bonus token (tau drops by one)",
        "specjax/decoding/speculative.py",
        "n_emit = _cut(block, n_acc + 1, state.limit - state.num_tokens, cfg.eos_id)",
        "n_emit = _cut(block, jnp.where(n_acc == k, n_acc, n_acc + 1), "
        "state.limit - state.num_tokens, cfg.eos_id)",
        "tests/test_speculative.py"),
    Bug("off_by_one_fill",
        "after rollback the cache's fill level counts one slot too many: the verify "
        "forward attends to a stale entry (the level the verify forward starts from; "
        "the one set at commit is reset there, so a bug in it alone is harmless)",
        "specjax/decoding/speculative.py",
        "  cache = cache.with_length(root_slot)\n",
        "  cache = cache.with_length(root_slot + 1)\n",
        "tests/test_speculative.py"),
    Bug("residual_not_renormalised",
        "the residual max(0, p - q) is drawn from as if it summed to one",
        "specjax/verify.py",
        "  return n, sampling.inverse_cdf(dist, u_draw)",
        "  cdf = jnp.cumsum(dist, axis=-1)\n"
        "  return n, jnp.minimum(jnp.sum(cdf <= u_draw[:, None], axis=-1),\n"
        "                        dist.shape[-1] - 1).astype(jnp.int32)",
        "tests/test_verify.py tests/test_exactness_analytic.py"),
    Bug("stale_tree_slot",
        "the accepted tree path's cache entries are not moved into place: the next "
        "round reads the entries of whichever nodes sat in those slots",
        "specjax/decoding/speculative.py",
        "    cache = trees.commit_path(cache, root_slot, path, n_acc, active)\n",
        "",
        "tests/test_tree.py"),
    Bug("q_from_wrong_position",
        "guess i is tested against the draft distribution of position i - 1",
        "specjax/verify.py",
        "  q_x = jnp.take_along_axis(q, tokens, axis=-1)[..., 0]\n"
        "  p_x = jnp.take_along_axis(p[:, :K], tokens, axis=-1)[..., 0]",
        "  q_x = jnp.take_along_axis(jnp.roll(q, 1, axis=1), tokens, axis=-1)[..., 0]\n"
        "  p_x = jnp.take_along_axis(p[:, :K], tokens, axis=-1)[..., 0]",
        "tests/test_verify.py tests/test_exactness_analytic.py"),
)


def apply(root: str, bug: Bug) -> None:
  path = os.path.join(root, bug.path)
  with open(path) as f:
    text = f.read()
  if text.count(bug.old) != 1:
    raise ValueError(f"{bug.name}: the text to replace occurs {text.count(bug.old)} times in "
                     f"{bug.path} (the code moved: update BUGS)")
  with open(path, "w") as f:
    f.write(text.replace(bug.old, bug.new))


def run(bug: Bug | None, tests: str) -> tuple[bool, str]:
  """-> (caught, the failing tests or the tail of pytest's output); bug None:
  the unmutated copy (the control)."""
  with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "repo")
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache"))
    # the copy sits where the shared data is expected, relative to the repository
    os.symlink(os.path.join(os.path.dirname(ROOT), "shared"), os.path.join(tmp, "shared"))
    if bug is not None:
      apply(root, bug)
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           *shlex.split(tests)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
  out = proc.stdout + proc.stderr
  failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
  if proc.returncode == 0:
    return False, out[-2000:]
  return True, ", ".join(failed) if failed else out[-2000:]


def main(argv) -> int:
  tests = None
  if "--tests" in argv:
    i = argv.index("--tests")
    tests = argv[i + 1]
    argv = argv[:i] + argv[i + 2:]
  if "--control" in argv:  # the same copies and selections without a bug
    selections = sorted({tests or b.tests for b in BUGS})
    failed = 0
    for sel in selections:
      broke, where = run(None, sel)
      failed += broke
      print(f"control {sel}: {'FAILED: ' + where if broke else 'passed'}", flush=True)
    return 1 if failed else 0
  unknown = set(argv) - {b.name for b in BUGS}
  if unknown:
    print(f"unknown bug(s) {sorted(unknown)}; known: {[b.name for b in BUGS]}")
    return 2
  chosen = [b for b in BUGS if not argv or b.name in argv]
  missed = 0
  for bug in chosen:
    caught, where = run(bug, tests or bug.tests)
    missed += not caught
    print(f"{bug.name}: {'caught by ' + where if caught else 'NOT CAUGHT'}", flush=True)
    if not caught:
      print(where)
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
