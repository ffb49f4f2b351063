"""The autoregressive baseline on a tiny random model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import tiny_config

CFG = tiny_config(eos_id=2, pad_id=0)
W = 32  # reference buffer width
PROMPTS = [[5, 9, 13], [7, 11, 3, 20, 31, 8, 4], [17]]
NEW = 10


@pytest.fixture(scope="module")
def params():
  p = transformer.init(jax.random.key(1), CFG)
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _full_logits(params, cfg, buf):
  c = cache_lib.init_cache(cfg, 1, W)
  logits, _, _ = transformer.forward(params, cfg, buf, jnp.arange(W)[None], c)
  return logits[0]


def reference_greedy(params, cfg, prompt, n):
  """No cache at all: re-run the whole sequence each step (right padding is
  invisible to earlier positions under the causal mask)."""
  seq = list(prompt)
  out = []
  for _ in range(n):
    buf = np.zeros((1, W), np.int32)
    buf[0, :len(seq)] = seq
    nxt = int(jnp.argmax(_full_logits(params, cfg, jnp.asarray(buf))[len(seq) - 1]))
    out.append(nxt)
    seq.append(nxt)
    if nxt == cfg.eos_id:
      break
  return out


def test_greedy_matches_cacheless_reference_on_ragged_batch(params):
  res = ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW)
  for prompt, got in zip(PROMPTS, res.tokens):
    assert got == reference_greedy(params, CFG, prompt, NEW)


def test_eos_stops_a_row_and_is_emitted(params):
  no_eos = CFG.replace(eos_id=-1)  # a token id that never occurs
  free = ar.generate(params, no_eos, PROMPTS, max_new_tokens=NEW).tokens
  assert all(len(t) == NEW for t in free)
  eos = free[1][3]  # make row 1's 4th token the EOS
  cfg = CFG.replace(eos_id=eos)
  res = ar.generate(params, cfg, PROMPTS, max_new_tokens=NEW)
  assert res.tokens[1] == free[1][:free[1].index(eos) + 1]
  for row_free, row in zip(free, res.tokens):
    stop = row_free.index(eos) + 1 if eos in row_free else NEW
    assert row == row_free[:stop]


def test_per_row_token_limits(params):
  res = ar.generate(params, CFG, PROMPTS, max_new_tokens=[2, 5, 1])
  full = ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW).tokens
  assert [len(t) for t in res.tokens] == [2, 5, 1]
  for a, b in zip(res.tokens, full):
    assert a == b[:len(a)]


def test_sampling_is_deterministic_and_per_request(params):
  s = sampling_lib.SamplingConfig(temperature=1.0)
  a = ar.generate(params, CFG, PROMPTS, key=7, sampling=s, max_new_tokens=NEW)
  b = ar.generate(params, CFG, PROMPTS, key=7, sampling=s, max_new_tokens=NEW)
  assert a.tokens == b.tokens
  c = ar.generate(params, CFG, PROMPTS, key=8, sampling=s, max_new_tokens=NEW)
  assert c.tokens != a.tokens
  # A request's output depends on its id, not its batch slot or batch mates.
  alone = ar.generate(params, CFG, [PROMPTS[1]], key=7, sampling=s, max_new_tokens=NEW,
                      request_ids=[1])
  assert alone.tokens[0] == a.tokens[1]
  swapped = ar.generate(params, CFG, [PROMPTS[2], PROMPTS[1], PROMPTS[0]], key=7, sampling=s,
                        max_new_tokens=NEW, request_ids=[2, 1, 0])
  assert swapped.tokens == a.tokens[::-1]


def test_prompt_longer_than_cache_is_refused(params):
  with pytest.raises(ValueError, match="cache slots"):
    ar.generate(params, CFG, [list(range(3, 40))], max_new_tokens=30, cache_slots=64)
  with pytest.raises(ValueError, match="max_new_tokens"):
    ar.generate(params, CFG, PROMPTS, max_new_tokens=0)
  with pytest.raises(ValueError, match="at least one token"):
    ar.generate(params, CFG, [[]], max_new_tokens=3)
  with pytest.raises(ValueError, match=r"one per prompt \(3\); got 2"):
    ar.generate(params, CFG, PROMPTS, max_new_tokens=[3, 4])
  for bad in (10.5, [3, 4.5, 3], True, float("nan")):  # would be cut to a whole number
    with pytest.raises(ValueError, match="max_new_tokens: a whole number of tokens"):
      ar.generate(params, CFG, PROMPTS, max_new_tokens=bad)
  assert (ar.generate(params, CFG, PROMPTS, max_new_tokens=float(NEW)).tokens ==
          ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW).tokens)
  assert (ar.generate(params, CFG, PROMPTS, max_new_tokens=[NEW]).tokens ==  # one for all
          ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW).tokens)
  # Ids outside the vocabulary would be wrapped or clamped by the embedding
  # gather; fractional ids truncated: both refused, by prompt and position.
  for prompt, match in (([1, 2, -1], "prompt 1: token id -1 at position 2"),
                        ([1, CFG.vocab_size], f"prompt 1: token id {CFG.vocab_size} at position 1"),
                        ([1, 2.5], "prompt 1: token ids must be a flat list of integers")):
    with pytest.raises(ValueError, match=match):
      ar.generate(params, CFG, [[3, 4], prompt], max_new_tokens=3)
