"""The exactness matrix behind experiments/exactness.py (configs/exactness.py,
MatrixSettings)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from specjax import sampling as sampling_lib
from specjax.analysis import exactness
from specjax.analysis import montecarlo
from specjax.checks import require_real, require_whole, require_whole_list
from specjax.errors import ConfigValueError
from specjax.settings import RunSettings, require

# Prompts of the tiny vocabulary: B = 4 is a ragged batch of these.
PROMPTS = [[3, 5, 1, 6], [2, 7], [4, 4, 1, 3, 4], [6]]


@dataclasses.dataclass(frozen=True)
class MatrixSettings(RunSettings):
  """An exactness matrix (`experiments/exactness.py`, configs/exactness.py):
  drafters x samplings x ks x batch_sizes, each a comma-separated list."""

  drafters: str = "draft_model,layer_skip,prompt_lookup,lookahead"  # of `make_tiny_drafter`
  # name=temperature/top_k/top_p
  samplings: str = "T1=1.0/0/1.0,T0.7=0.7/0/1.0,topk=1.0/4/1.0,topp=1.0/0/0.9"
  ks: str = "1,3,5"
  batch_sizes: str = "1,4"  # B rows of PROMPTS (B = 4: a ragged batch; at most len(PROMPTS))
  num_samples: int = 100_000  # requests per setting, shared by its B prompts
  num_tokens: int = 4  # the joint law of the first num_tokens emitted tokens
  seed: int = 0
  family_alpha: float = 1e-3  # Holm's family-wise level over the whole matrix
  out: str = ""  # a JSON file of the rows (written by experiments/exactness.py; '': none)


DRAFTERS = ("draft_model", "layer_skip", "prompt_lookup", "lookahead")


def make_tiny_drafter(name: str, k: int, dcfg):
  """Drafters that run on the tiny pair (the draft model samples at T = 1)."""
  from specjax.drafters.draft_model import DraftModel  # pylint: disable=import-outside-toplevel
  from specjax.drafters.layer_skip import LayerSkip  # pylint: disable=import-outside-toplevel
  from specjax.drafters.prompt_lookup import PromptLookup  # pylint: disable=import-outside-toplevel

  t1 = sampling_lib.SamplingConfig(temperature=1.0)
  if name == "draft_model":
    return DraftModel(k=k, cfg=dcfg, sampling=t1), True
  if name == "layer_skip":
    return LayerSkip(k=k, layers=(0,), sampling=t1), False
  if name == "prompt_lookup":
    return PromptLookup(k=k, max_ngram=2), False
  if name == "lookahead":
    from specjax.drafters.lookahead import Lookahead  # pylint: disable=import-outside-toplevel
    return Lookahead(k=k), False
  raise ValueError(f"unknown drafter {name!r} ({', '.join(DRAFTERS)})")


def parse_samplings(spec: str):
  """'name=temperature/top_k/top_p,...' -> {name: SamplingConfig}; a malformed
  item is refused by name (ConfigValueError)."""
  out = {}
  for item in spec.split(","):
    try:
      name, vals = item.split("=")
      t, k, p = vals.split("/")
      t, k, p = float(t), int(k), float(p)
    except ValueError as e:
      raise ConfigValueError(f"samplings={spec!r}: {item!r} is not "
                             f"name=temperature/top_k/top_p ({e})") from e
    try:
      out[name] = sampling_lib.SamplingConfig(temperature=t, top_k=k, top_p=p)
    except ValueError as e:
      raise ConfigValueError(f"samplings={spec!r}: {item!r}: {e}") from e
  return out


def check(c: MatrixSettings) -> tuple:
  """The matrix's (drafters, samplings, ks, batch sizes), every setting
  checked before the tiny pair is built (ConfigValueError naming the first bad one)."""
  drafters = c.drafters.split(",")
  unknown = [d for d in drafters if d not in DRAFTERS]
  if unknown:
    raise ConfigValueError(f"drafters: unknown {unknown} (known: {', '.join(DRAFTERS)})")
  require_whole("num_samples", c.num_samples, 1)
  require_whole("num_tokens", c.num_tokens, 1)
  require_whole("seed", c.seed, 0)
  require_real("family_alpha", c.family_alpha, 0.0, 1.0, low_open=True, high_open=True)
  return (drafters, parse_samplings(c.samplings), require_whole_list("ks", c.ks),
          require_whole_list("batch_sizes", c.batch_sizes, 1, len(PROMPTS)))


def run_matrix(c: MatrixSettings, log=print) -> list:
  """Vet every setting of `c` (`MatrixSettings.of(config)` reads
  configs/exactness.py's ConfigDict) -> one row per (setting, prompt), with
  Holm's verdict over the whole matrix."""
  require(c, MatrixSettings, "vetting.run_matrix")
  drafters, samplings, ks, batch_sizes = check(c)
  params, cfg, dparams, dcfg = montecarlo.tiny_pair()
  rows = []
  grid = itertools.product(drafters, samplings.items(), ks, batch_sizes)
  for name, (sname, sampling), k, b in grid:
    drafter, uses_draft = make_tiny_drafter(name, k, dcfg)
    res = montecarlo.vet_drafter(params, cfg, drafter, PROMPTS[:b], sampling=sampling,
                                 draft_params=dparams if uses_draft else None,
                                 num_samples=int(c.num_samples), num_tokens=int(c.num_tokens),
                                 seed=int(c.seed))
    for i, r in enumerate(res["per_prompt"]):
      row = dict(drafter=name, sampling=sname, k=k, batch_size=b, prompt=i, alpha=res["alpha"],
                 **r)
      rows.append(row)
      log(f"{name:14s} {sname:6s} k={k} B={b} prompt {i}: p={r['pvalue']:.4f} "
          f"TV={r['tv']:.4f} (noise bound {r['tv_bound']:.4f}, detectable "
          f"{r['detectable_tv']:.4f}) alpha={res['alpha']:.3f}")
  rejected = exactness.holm_bonferroni(np.array([r["pvalue"] for r in rows]), c.family_alpha)
  for r, rej in zip(rows, rejected):
    r["rejected"] = bool(rej)
  log(f"{len(rows)} tests, {int(rejected.sum())} rejected by Holm at family-wise "
      f"{c.family_alpha}")
  return rows
