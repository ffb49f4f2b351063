"""End-to-end exactness checks of a whole decoding method.

Two tests, both deterministic given their seeds:

* `joint_test`: run the full speculative generate for many independent
  requests (one row per sample; rows use per-request keys, so a batch of N
  rows is N independent runs), and compare the empirical joint law of the
  first m emitted tokens with the target's exact joint law, enumerated by
  teacher-forced forwards of every prefix (small vocabularies only). Reports
  a chi-square p-value, the TV distance, the TV an exact sampler stays below
  at this sample size, and the smallest TV the test detects.
* `pit_test`: over a long horizon (bonus tokens, all-accept rounds and
  drafter catch-up all occur), the randomized probability integral transform
  u = F(x - 1) + U * p(x), with p the target's processed distribution given
  the emitted prefix (one teacher-forced forward), is Uniform(0, 1) per
  position and pooled iff every token was drawn from p. Works on any vocabulary,
  SmolLM2's included.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.analysis import exactness
from specjax.decoding import speculative
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "start"))
def _teacher_forced_probs(params, cfg: ModelConfig, tokens, sampling, start: int = 0):
  """Processed next-token distributions at positions start.. of (N, T) tokens:
  (N, T - start, V). The LM head and the sampling transform run only there."""
  n, t = tokens.shape
  cache = cache_lib.init_cache(cfg, n, cache_lib.round_up(t, 8))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
  _, hidden, _ = transformer.forward(params, cfg, tokens, pos, cache, compute_logits=False)
  return sampling_lib.probs(transformer.lm_head(params, cfg, hidden[:, start:]), sampling)


def exact_joint(params, cfg: ModelConfig, prompt: Sequence[int], num_tokens: int,
                sampling: sampling_lib.SamplingConfig) -> np.ndarray:
  """The target's exact joint law of its first `num_tokens` tokens: shape (V,) * m.

  Enumerates all V^(m-1) prefixes and runs one teacher-forced forward each.
  """
  v, m = cfg.vocab_size, num_tokens
  if v ** (m - 1) > 1 << 16:
    raise ValueError(f"enumerating {v}^{m - 1} prefixes is too many; use pit_test")
  combos = np.array(list(itertools.product(range(v), repeat=m - 1)), np.int32)
  combos = combos.reshape(-1, m - 1)
  seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(combos), 1)), combos], 1)
  p0 = len(prompt) - 1
  probs = np.asarray(_teacher_forced_probs(params, cfg, jnp.asarray(seqs), sampling, start=p0),
                     np.float64)
  # joint[c, x] = prod_i p_{p0+i}(c_i | c_<i) * p_{p0+m-1}(x | c)  (probs[:, i] is p_{p0+i})
  weight = np.ones(len(combos))
  for i in range(m - 1):
    weight *= probs[np.arange(len(combos)), i, combos[:, i]]
  joint = weight[:, None] * probs[:, m - 1, :]
  return joint.reshape((v,) * m)


def sample_tokens(params, cfg: ModelConfig, drafter, prompts: Sequence[Sequence[int]],
                  num_samples: int, num_tokens: int, *, draft_params=None, seed: int = 0,
                  spec: speculative.SpecConfig, chunk: int = 50_000):
  """`num_samples` independent runs per prompt, as rows of batched generates.

  Rows cycle through the prompts (a mixed, ragged batch when there are
  several); each row has its own request id. Returns a list (one per prompt)
  of (num_samples, num_tokens) int arrays, and the summed loop stats.
  """
  total = num_samples * len(prompts)
  out = [[] for _ in prompts]
  stats = {"proposed": 0, "accepted": 0, "reached": None, "kept": None}
  for start in range(0, total, chunk):
    ids = np.arange(start, min(start + chunk, total))
    batch = [prompts[i % len(prompts)] for i in ids]
    res = speculative.generate(params, cfg, drafter, batch, draft_params=draft_params,
                               key=seed, spec=spec, max_new_tokens=num_tokens, request_ids=ids)
    toks = res.tokens
    for j, i in enumerate(ids):
      if len(toks[j]) != num_tokens:
        raise ValueError(f"row {i} emitted {len(toks[j])} tokens, expected {num_tokens}; "
                         "use a config whose eos_id never occurs")
      out[i % len(prompts)].append(toks[j])
    for key in ("proposed", "accepted"):
      stats[key] += res.stats[key]
    acc = np.asarray(res.stats["per_position_acceptance"])
    stats["per_position_acceptance"] = acc if stats.get("per_position_acceptance") is None \
        else np.minimum(stats["per_position_acceptance"], acc)
  return [np.asarray(o, np.int32) for o in out], stats


@dataclasses.dataclass
class JointResult:
  pvalue: float
  tv: float
  tv_bound: float
  detectable_tv: float
  num_samples: int
  num_categories: int


def joint_test(samples: np.ndarray, joint: np.ndarray) -> JointResult:
  """Chi-square and TV of sampled sequences (N, m) against the exact joint."""
  v = joint.shape[0]
  m = samples.shape[1]
  flat = np.ravel_multi_index(samples.T, (v,) * m)
  cats = v ** m
  counts = np.bincount(flat, minlength=cats)
  expected = joint.reshape(-1) / joint.sum()
  chi = exactness.chi_square_test(counts, expected)
  emp = counts / counts.sum()
  support = int(np.sum(expected > 0))
  return JointResult(
      pvalue=float(chi.pvalue), tv=float(exactness.tv_distance(emp, expected)),
      tv_bound=float(exactness.tv_noise_bound(support, len(samples))),
      detectable_tv=float(exactness.detectable_tv(support, len(samples))),
      num_samples=len(samples), num_categories=support)


@dataclasses.dataclass
class PITResult:
  pooled_pvalue: float
  per_position_pvalues: np.ndarray
  num_values: int


def pit_values(params, cfg: ModelConfig, prompt: Sequence[int], samples: np.ndarray,
               sampling: sampling_lib.SamplingConfig, seed: int = 0,
               chunk: int = 256) -> np.ndarray:
  """Randomized PIT values (N, L) of sampled continuations (N, L) of one prompt."""
  n, length = samples.shape
  rng = np.random.default_rng(seed)
  out = np.empty((n, length))
  plen = len(prompt)
  for s in range(0, n, chunk):
    seq = np.concatenate([np.tile(np.asarray(prompt, np.int32), (min(chunk, n - s), 1)),
                          samples[s:s + chunk]], 1)
    pad = chunk - seq.shape[0]  # one compiled shape for every chunk
    seq = np.pad(seq, ((0, pad), (0, 0)))
    probs = np.asarray(_teacher_forced_probs(params, cfg, jnp.asarray(seq), sampling,
                                             start=plen - 1),
                       np.float64)[:chunk - pad, :length]
    x = samples[s:s + chunk]
    cdf = np.cumsum(probs, axis=-1)
    p_x = np.take_along_axis(probs, x[..., None], -1)[..., 0]
    lower = np.take_along_axis(cdf, x[..., None], -1)[..., 0] - p_x
    out[s:s + chunk] = exactness.randomized_pit(lower, p_x, rng.random(p_x.shape))
  return out


def pit_test(values: np.ndarray) -> PITResult:
  per = np.array([exactness.uniformity_test(values[:, i]).pvalue
                  for i in range(values.shape[1])])
  pooled = exactness.uniformity_test(values.reshape(-1)).pvalue
  return PITResult(pooled_pvalue=float(pooled), per_position_pvalues=per,
                   num_values=int(values.size))


def tiny_pair(vocab_size: int = 8, target_seed: int = 23, draft_seed: int = 12,
              scale: float = 0.25):
  """A tiny target (2 layers) and draft model (1 layer) over a small vocabulary
  whose next-token laws are far apart (TV ~0.35-0.55 on short prompts), so that
  rejections, residual draws and bonus tokens all occur. Neither ever emits EOS
  (eos_id = -1), so every run has the full horizon. Width 16 (2 query heads,
  1 KV head of 8): the Monte-Carlo tests run 10^5 requests per setting, and at
  this width a request costs a third of the default tiny model's.
  Returns (target_params, target_cfg, draft_params, draft_cfg).
  """
  from specjax.models.config import tiny_config  # pylint: disable=import-outside-toplevel

  dims = dict(vocab_size=vocab_size, dim=16, ffn_dim=32, num_heads=2, num_kv_heads=1,
              head_dim=8, eos_id=-1, pad_id=0, max_seq_len=64)
  cfg = tiny_config(**dims)
  dcfg = tiny_config(num_layers=1, **dims)
  target = transformer.init(jax.random.key(target_seed), cfg)
  draft = transformer.init(jax.random.key(draft_seed), dcfg)
  return (dict(target, embed=target["embed"] * scale), cfg,
          dict(draft, embed=draft["embed"] * scale), dcfg)


def vet_drafter(params, cfg: ModelConfig, drafter, prompts, *, sampling, draft_params=None,
                num_samples: int = 100_000, num_tokens: int = 4, seed: int = 0) -> dict:
  """Joint-law test of one drafter/sampling setting: what a researcher runs on
  a new drafter. Returns p-values, TV and the detectable TV per prompt."""
  spec = speculative.SpecConfig(sampling=sampling)
  samples, stats = sample_tokens(params, cfg, drafter, prompts, num_samples // len(prompts),
                                 num_tokens, draft_params=draft_params, seed=seed, spec=spec)
  out = []
  for s, p in zip(samples, prompts):
    r = joint_test(s, exact_joint(params, cfg, p, num_tokens, sampling))
    out.append(dataclasses.asdict(r))
  return {"per_prompt": out, "alpha": stats["accepted"] / max(stats["proposed"], 1),
          "per_position_acceptance": np.asarray(stats["per_position_acceptance"]).tolist()}
