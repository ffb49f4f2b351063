"""Adding a drafter takes one class and one registry row.

`RepeatNgram` below (a test fixture, not shipped) guesses that the newest n
committed tokens repeat: after "... a b" (n = 2) it proposes "a b a b ...".
Registered under a name, it is built by `registry.make_drafter` like the
built-in methods and goes through the same checks: greedy output equals AR's
token for token, and sampled output follows the target's law (the Monte-Carlo
joint test of tests/test_exactness_montecarlo.py, with a negative control: the
same guesses offered with a wrong q must be rejected by the same test).
"""

import dataclasses
import types

import jax.numpy as jnp
import pytest

from specjax import sampling as sampling_lib
from specjax.analysis import montecarlo as mc
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters import registry
from specjax.drafters.base import Drafter, Proposal
from specjax.drafters.chain import cut_at_eos, one_hot_q


# --- the new drafter: one class ...


@dataclasses.dataclass(frozen=True)
class RepeatNgram(Drafter):
  """Guesses the newest `n` committed tokens again, cyclically (deterministic
  guesses: q is their one-hot)."""

  n: int = 2
  name = "repeat_ngram"

  def draft(self, params, target, state, ctx, keys):
    idx = ctx.length[:, None] - self.n + jnp.arange(self.k)[None] % self.n
    tokens = jnp.take_along_axis(ctx.history, jnp.maximum(idx, 0), axis=1)
    num = jnp.where(ctx.active & (ctx.length >= self.n), self.k, 0).astype(jnp.int32)
    num = cut_at_eos(tokens, num, target.cfg.eos_id)
    q = one_hot_q(tokens, target.cfg.vocab_size)
    return Proposal(tokens=tokens, q=q, num_proposed=num), state


# ... and one registry row (n from the config's max_ngram field)
if "repeat_ngram" not in registry.BUILDERS:
  registry.register("repeat_ngram",
                    lambda r: (RepeatNgram(k=r.k, n=int(r.settings.max_ngram)), None))


@dataclasses.dataclass(frozen=True)
class _WrongQ(RepeatNgram):
  """Negative control: the same deterministic guesses claimed to be drawn from
  a uniform q, so the rule accepts them with min(1, p / q) instead of p."""

  def draft(self, params, target, state, ctx, keys):
    prop, state = super().draft(params, target, state, ctx, keys)
    return prop.replace(q=jnp.full_like(prop.q, 1.0 / prop.q.shape[-1])), state


TARGET, CFG, _, _ = mc.tiny_pair(vocab_size=8)
MODEL = types.SimpleNamespace(params=TARGET, cfg=CFG)
PROMPTS = [[3, 5, 1, 6], [2, 7], [4, 4, 1, 3, 4], [6]]


def test_the_registered_name_builds_it_everywhere_a_method_name_works():
  assert "repeat_ngram" in registry.available_methods()
  drafter, params = registry.make_drafter("repeat_ngram@k=3@max_ngram=3", {}, MODEL)
  assert drafter == RepeatNgram(k=3, n=3) and params is None
  settings = registry.DrafterSettings(k=2, max_ngram=4)  # typed settings, no config
  assert registry.make_drafter("repeat_ngram", settings, MODEL)[0] == RepeatNgram(k=2, n=4)


def test_greedy_output_equals_ar_and_guesses_are_accepted():
  drafter, _ = registry.make_drafter("repeat_ngram", {"k": 3}, MODEL)
  want = ar.generate(TARGET, CFG, PROMPTS, max_new_tokens=12).tokens
  got = sp.generate(TARGET, CFG, drafter, PROMPTS, max_new_tokens=12)
  assert got.tokens == want
  assert 0 < got.stats["accepted"] < got.stats["proposed"]


N = 40_000


def _joint_test(drafter):
  sampling = sampling_lib.SamplingConfig(temperature=1.0)
  samples, stats = mc.sample_tokens(TARGET, CFG, drafter, PROMPTS[:1], N, 4,
                                    spec=sp.SpecConfig(sampling=sampling))
  return mc.joint_test(samples[0], mc.exact_joint(TARGET, CFG, PROMPTS[0], 4, sampling)), stats


@pytest.mark.slow
def test_sampled_output_follows_the_target_and_a_wrong_q_is_rejected():
  result, stats = _joint_test(RepeatNgram(k=2))
  assert 0 < stats["accepted"] < stats["proposed"]
  assert result.detectable_tv < 0.35, result  # what N = 40k samples can see (0.34)
  assert result.pvalue > 1e-3 and result.tv < result.tv_bound, result
  bad, _ = _joint_test(_WrongQ(k=2))
  assert bad.pvalue < 1e-6, bad
