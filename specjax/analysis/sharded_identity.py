"""Sharded runs against the single-device run: the same outputs on any mesh.

For each method (AR or a drafter), sampling setting and mesh shape, the batch
is decoded once on the default device and once on the mesh
(`specjax.sharding`), and the outputs are compared row by row: sampled
outputs must be identical (keys are per request and random bits do not
depend on the split); greedy outputs are compared with the near-tie rule of
`specjax.analysis.greedy_identity` (a split contraction sums in another
order, which may flip a near-tied argmax, and nothing else).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from specjax import sampling as sampling_lib
from specjax import sharding
from specjax.analysis import greedy_identity
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp

# A method: (name, drafter or None for AR, draft params).
Method = Tuple[str, object, object]


def decode(params, cfg, method: Method, prompts, *, sampling, mesh=None, key=0,
           max_new_tokens=16) -> list:
  """Token lists of one run of `method` (no mesh: the default device)."""
  _, drafter, dparams = method
  if drafter is None:
    return ar.generate(params, cfg, prompts, key=key, sampling=sampling,
                       max_new_tokens=max_new_tokens, mesh=mesh).tokens
  return sp.generate(params, cfg, drafter, prompts, draft_params=dparams, key=key,
                     spec=sp.SpecConfig(sampling=sampling), max_new_tokens=max_new_tokens,
                     mesh=mesh).tokens


def compare_rows(params, cfg, prompts, reference, candidate, greedy: bool,
                 delta: float) -> dict:
  """Per-row verdicts -> {"status": worst of identical < near_tie < diverged, counts}."""
  counts = {"identical": 0, "near_tie": 0, "diverged": 0}
  for prompt, ref, got in zip(prompts, reference, candidate):
    if greedy:
      status = greedy_identity.compare(params, cfg, prompt, ref, got, delta).status
    else:
      status = "identical" if ref == got else "diverged"
    counts[status] += 1
  worst = "diverged" if counts["diverged"] else "near_tie" if counts["near_tie"] else "identical"
  return {"status": worst, **counts}


def check(params, cfg, methods: Callable[[sampling_lib.SamplingConfig], Iterable[Method]],
          prompts: Sequence[Sequence[int]], meshes: Sequence, samplings: Sequence, *,
          delta: float, key: int = 0, max_new_tokens: int = 16,
          greedy_reference: Optional[list] = None,
          progress: Optional[Callable[[dict], None]] = None) -> List[dict]:
  """Every method (built per sampling setting by `methods(sampling)`) on every
  mesh shape, against its single-device run. -> one record per (sampling,
  method, mesh).

  `greedy_reference`: the single-device greedy AR output for these prompts
  (and `max_new_tokens`); greedy runs of every method are compared with it
  instead of with their own single-device run -- a stronger check (greedy
  speculative decoding equals AR) that saves one compile per method."""
  records = []
  for sampling in samplings:
    for method in methods(sampling):
      t0 = time.perf_counter()
      if sampling.greedy and greedy_reference is not None:
        ref = greedy_reference
      else:
        ref = decode(params, cfg, method, prompts, sampling=sampling, key=key,
                     max_new_tokens=max_new_tokens)
      single_s = time.perf_counter() - t0
      for shape in meshes:
        t0 = time.perf_counter()
        got = decode(params, cfg, method, prompts, sampling=sampling,
                     mesh=sharding.make_mesh(shape), key=key, max_new_tokens=max_new_tokens)
        rec = {"method": method[0], "mesh": list(sharding.parse_mesh_shape(shape)),
               "sampling": "greedy" if sampling.greedy else "sampled",
               "rows": len(prompts), "tokens": sum(len(t) for t in got),
               **compare_rows(params, cfg, prompts, ref, got, sampling.greedy, delta),
               "single_s": round(single_s, 2), "sharded_s": round(time.perf_counter() - t0, 2)}
        records.append(rec)
        if progress is not None:
          progress(rec)
  return records
