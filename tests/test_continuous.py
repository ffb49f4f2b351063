"""Continuous batching: every request's tokens equal its static-batch AR
tokens (greedy and sampled), whichever row and step it was decoded at."""

import jax
import numpy as np
import pytest

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import continuous
from specjax.models import transformer
from specjax.models.config import tiny_config

CFG = tiny_config(eos_id=-1, pad_id=0)
SAMPLED = sampling_lib.SamplingConfig(temperature=0.9, top_p=0.95)
NEW = 24


@pytest.fixture(scope="module")
def model():
  """A tiny random model whose EOS is its most frequent greedy token, so that
  answers end at many different lengths."""
  params = transformer.init(jax.random.key(4), CFG)
  out = ar.generate(params, CFG, [r[1] for r in _requests()], max_new_tokens=NEW).tokens
  counts = np.bincount(np.concatenate(out), minlength=CFG.vocab_size)
  counts[:3] = 0  # not pad / bos
  return params, CFG.replace(eos_id=int(np.argmax(counts)))


def _requests(n=11, seed=0):
  """(id, prompt, token limit): ragged prompts, limits from 1 to NEW."""
  rng = np.random.default_rng(seed)
  return [(100 + 3 * i, rng.integers(3, CFG.vocab_size, size=int(rng.integers(1, 30))).tolist(),
           int(rng.integers(1, NEW + 1))) for i in range(n)]


@pytest.mark.parametrize("sampling", [sampling_lib.GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_request_equals_its_static_batch_tokens(model, sampling):
  params, cfg = model
  reqs = _requests()
  want = ar.generate(params, cfg, [r[1] for r in reqs], key=5, sampling=sampling,
                     max_new_tokens=[r[2] for r in reqs], request_ids=[r[0] for r in reqs]).tokens
  stats = continuous.Stats()
  got = dict(continuous.generate(params, cfg, iter(reqs), batch_size=4, refill=2,
                                 max_new_tokens=NEW, max_prompt_tokens=32, key=5,
                                 sampling=sampling, chunk_steps=5, stats=stats))
  assert sorted(got) == [r[0] for r in reqs]
  lengths = {len(t) for t in want}
  assert len(lengths) > 3, lengths  # answers of many lengths: rows were refilled mid-run
  for (rid, _, _), tokens in zip(reqs, want):
    assert got[rid] == tokens, rid
  assert stats.requests == len(reqs) and stats.new_tokens == sum(len(t) for t in want)
  assert stats.prefills >= len(reqs) // 2 and 0 < stats.occupancy <= 1


def test_bad_requests_are_refused(model):
  params, _ = model
  with pytest.raises(ValueError, match="prompt of 40 tokens"):
    list(continuous.generate(params, CFG, [(0, [3] * 40)], batch_size=2, max_new_tokens=4,
                             max_prompt_tokens=32))
  with pytest.raises(ValueError, match="token limit 5"):
    list(continuous.generate(params, CFG, [(0, [3], 5)], batch_size=2, max_new_tokens=4,
                             max_prompt_tokens=32))
  with pytest.raises(ValueError, match="request 0: token limit 2.5 is not a whole number"):
    list(continuous.generate(params, CFG, [(0, [3], 2.5)], batch_size=2, max_new_tokens=4,
                             max_prompt_tokens=32))
  with pytest.raises(ValueError, match="max_new_tokens: a whole number of tokens"):
    list(continuous.generate(params, CFG, [(0, [3])], batch_size=2, max_new_tokens=4.5,
                             max_prompt_tokens=32))
  with pytest.raises(ValueError, match="refill"):
    list(continuous.generate(params, CFG, [(0, [3])], batch_size=2, refill=3, max_new_tokens=4,
                             max_prompt_tokens=32))
  with pytest.raises(ValueError, match=f"request 4: token id {CFG.vocab_size} at position 1"):
    list(continuous.generate(params, CFG, [(4, [3, CFG.vocab_size])], batch_size=2,
                             max_new_tokens=4, max_prompt_tokens=32))
  for run in (continuous.generate, continuous.generate_bucketed):
    with pytest.raises(ValueError, match="request id 1 repeats"):
      list(run(params, CFG, [(1, [3]), (1, [4] * 20)], batch_size=2, max_new_tokens=4,
               max_prompt_tokens=32))
  # pad_id -1 is a model's own setting (no pad token), not a request's id: a
  # refill group short of rows is filled with it and still runs
  no_pad = CFG.replace(pad_id=-1)
  got = dict(continuous.generate(params, no_pad, [(0, [5, 6])], batch_size=2, refill=2,
                                 max_new_tokens=4, max_prompt_tokens=32))
  assert got[0] == ar.generate(params, no_pad, [[5, 6]], max_new_tokens=4,
                               request_ids=[0]).tokens[0]
