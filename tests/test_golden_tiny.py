"""The golden tokens reproduce on the tiny target (SmolLM2's: test_golden.py):
every drafter, chain and tree, B = 1 and ragged B = 4, greedy and sampled.

A mismatch means the tokens some run produces changed; see test_golden.py and
golden.py for what to do. Greedy runs also prove greedy identity: every
drafter's tokens equal the AR tokens of the same batch exactly.
"""

import pytest

import golden


@pytest.fixture(scope="module")
def expected():
  return golden.load()


@pytest.mark.slow  # 64 programs: ~5 min of compiles on 2 cores
def test_tiny_target_reproduces_the_golden_tokens(expected):
  got = golden.tiny_runs()
  bad = golden.mismatches(got, expected, "tiny/")
  assert not bad, bad
  for name, tokens in got.items():  # greedy identity, every drafter, B = 1 and 4
    kind, batch = name.split("/")[1:3]
    if kind == "greedy":
      assert tokens == got[f"tiny/greedy/{batch}/ar"], name
