"""Golden tokens: the exact output of a fixed set of runs, pinned across refactors.

Every drafter (chains and trees) on a tiny random target, B = 1 and a ragged
B = 4, greedy and sampled with fixed keys; on SmolLM2-135M-Instruct one ragged
batch (the shortest Spec-Bench prompt of each category) per shipped drafter,
greedy and sampled, plus prompt lookup and the trees greedy. The
tokens are committed in `golden_tokens.json`; `test_golden.py` reproduces them.

Work that changes numerics or checkpoints on purpose regenerates the file and
says why in the commit:

  python tests/golden.py            # both parts
  python tests/golden.py --tiny     # the tiny target only
  python tests/golden.py --smollm2  # SmolLM2 only

One token budget per model keeps the programs few: each tiny run compiles
once per (drafter, batch size, greedy or sampled).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.decoding import autoregressive as ar
from specjax.decoding import speculative as sp
from specjax.drafters.draft_model import DraftModel
from specjax.drafters.eagle import Eagle, init_head, prepare
from specjax.drafters.eagle_tree import EagleTree
from specjax.drafters.layer_skip import LayerSkip
from specjax.drafters.lookahead import Lookahead, LookaheadTree
from specjax.drafters.medusa import Blockwise, Medusa, MedusaTree
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.drafters.replay import AlwaysReject, Replay, replay_params
from specjax.models import transformer
from specjax.models.config import tiny_config

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_tokens.json")

# --- the tiny target ------------------------------------------------------------

CFG = tiny_config(eos_id=-1, pad_id=0)
DCFG = tiny_config(num_layers=1, eos_id=-1, pad_id=0)
PROMPTS = {"B1": [[5, 9, 13, 5, 9]],
           "B4": [[5, 9, 13, 5, 9], [7, 11, 3, 20, 31, 8, 4], [17], [4, 4, 6, 4, 4]]}
NEW = 14
SAMPLINGS = {"greedy": sampling_lib.GREEDY,
             "sampled": sampling_lib.SamplingConfig(temperature=0.8, top_p=0.9)}
TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))


def tiny_models():
  """(target params, draft params, medusa heads, eagle heads, eagle-3 heads)."""
  target = transformer.init(jax.random.key(1), CFG)
  target = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, target)
  draft = transformer.init(jax.random.key(2), DCFG)
  draft = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, draft)
  kw, kb = jax.random.split(jax.random.key(3))
  d = CFG.dim
  heads = {"w": 2.0 * jax.random.normal(kw, (3, d, d)) / np.sqrt(d),
           "b": jax.random.normal(kb, (3, d))}

  def eagle(fused, seed):
    head = init_head(jax.random.key(seed), CFG, fused=fused,
                     vocab=jnp.arange(0, CFG.vocab_size, 2) if fused else None)
    head["fc"] = 0.5 * jax.random.normal(jax.random.key(seed + 1), (d, 2 * d)) / np.sqrt(2 * d)
    return prepare(head, target, CFG)

  return target, draft, heads, eagle(False, 9), eagle(True, 11)


def tiny_drafters(sampling, target, draft, heads, eagle_heads, eagle3_heads, reference):
  """name -> (drafter, draft params); drafters that sample use the target's settings."""
  s = sampling
  return {
      "draft_model": (DraftModel(k=3, cfg=DCFG, sampling=s), draft),
      "draft_model_stop": (DraftModel(k=3, cfg=DCFG, sampling=s, draft_stop=0.3), draft),
      "layer_skip": (LayerSkip(k=3, layers=(0,), sampling=s), None),
      "prompt_lookup": (PromptLookup(k=3), None),
      "replay": (Replay(k=4), replay_params(reference)),
      "always_reject": (AlwaysReject(k=2), None),
      "medusa": (Medusa(k=3, sampling=s), heads),
      "blockwise": (Blockwise(k=3), heads),
      "eagle": (Eagle(k=3, sampling=s), eagle_heads),
      "eagle3": (Eagle(k=3, sampling=s, fused=True), eagle3_heads),
      "medusa_tree": (MedusaTree(k=2, choices=TREE, sampling=s), heads),
      "eagle_tree": (EagleTree(k=2, tree_topk=3, tree_width=2, tree_nodes=8, sampling=s), eagle_heads),
      "eagle3_tree": (EagleTree(k=2, tree_topk=3, tree_width=2, tree_nodes=5, tree_mode="topk", fused=True,
                                sampling=s), eagle3_heads),
      "lookahead": (Lookahead(k=2, window=2, ngram=3, max_candidates=3, pool_size=16), None),
      "lookahead_tree": (LookaheadTree(k=2, window=2, ngram=3, max_candidates=3, pool_size=16), None),
  }


def tiny_runs() -> Dict[str, List[List[int]]]:
  target, draft, heads, eh, e3h = tiny_models()
  out = {}
  for sname, sampling in SAMPLINGS.items():
    spec = sp.SpecConfig(sampling=sampling)
    for bname, prompts in PROMPTS.items():
      ref = ar.generate(target, CFG, prompts, max_new_tokens=NEW, sampling=sampling).tokens
      out[f"tiny/{sname}/{bname}/ar"] = ref
      for name, (drafter, dparams) in tiny_drafters(sampling, target, draft, heads, eh, e3h,
                                                    ref).items():
        res = sp.generate(target, CFG, drafter, prompts, draft_params=dparams,
                          max_new_tokens=NEW, spec=spec)
        out[f"tiny/{sname}/{bname}/{name}"] = res.tokens
        _progress(f"tiny/{sname}/{bname}/{name}")
  return out


# --- SmolLM2 ----------------------------------------------------------------------

SPEC_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                          "data", "spec_bench", "question_excl_mtbench.jsonl")
MAX_CHARS = 700  # long RAG / summarization records are cut (head + tail) to one bucket
SMOLLM2_NEW = 32
# Greedy: every method of the SmolLM2 greedy-identity test (the same programs
# serve both); sampled: AR and the shipped drafters.
SMOLLM2_GREEDY = ("prompt_lookup", "draft_model", "medusa", "medusa_tree", "eagle", "eagle3",
                  "eagle3_tree")
SMOLLM2_SAMPLED = ("draft_model", "medusa", "eagle", "eagle3")
SMOLLM2_SAMPLING = sampling_lib.SamplingConfig(temperature=0.8, top_k=50)
# method -> its settings (k = 3; EAGLE-3's chain over the full vocabulary)
SMOLLM2_SETTINGS = {"prompt_lookup": {"k": 4}, "eagle3": {"k": 3, "draft_vocab": "full"},
                    "medusa_tree": {"k": 3, "tree_nodes": 16},
                    "eagle3_tree": {"k": 3, "tree_nodes": 16}}


def smollm2_prompts(tokenizer) -> List[List[int]]:
  """The shortest Spec-Bench prompt of each category (sorted by category), through
  the chat template: one ragged batch of 5 (the 4 the issue asks for, plus one
  so that every category is in the greedy-identity test that shares these runs)."""
  best = {}
  with open(SPEC_BENCH) as f:
    for line in f:
      rec = json.loads(line)
      text = rec["turns"][0]
      if len(text) > MAX_CHARS:
        text = text[:MAX_CHARS // 2] + " ... " + text[-MAX_CHARS // 2:]
      ids = tokenizer.encode_prompt(text)
      if rec["category"] not in best or len(ids) < len(best[rec["category"]]):
        best[rec["category"]] = ids
  return [best[c] for c in sorted(best)]


def smollm2_drafter(method: str, model, sampling):
  from specjax.drafters import registry  # pylint: disable=import-outside-toplevel
  return registry.make_drafter(method, SMOLLM2_SETTINGS.get(method, {"k": 3}), model,
                               sampling=sampling)


def smollm2_runs(model) -> Dict[str, List[List[int]]]:
  prompts = smollm2_prompts(model.tokenizer)
  out = {}
  for sname, sampling, methods in (("greedy", sampling_lib.GREEDY, SMOLLM2_GREEDY),
                                   ("sampled", SMOLLM2_SAMPLING, SMOLLM2_SAMPLED)):
    out[f"smollm2/{sname}/ar"] = ar.generate(model.params, model.cfg, prompts,
                                             max_new_tokens=SMOLLM2_NEW,
                                             sampling=sampling).tokens
    for method in methods:
      drafter, dparams = smollm2_drafter(method, model, sampling)
      res = sp.generate(model.params, model.cfg, drafter, prompts, draft_params=dparams,
                        max_new_tokens=SMOLLM2_NEW, spec=sp.SpecConfig(sampling=sampling))
      out[f"smollm2/{sname}/{method}"] = res.tokens
      _progress(f"smollm2/{sname}/{method}")
  return out


def _progress(name: str) -> None:
  if __name__ == "__main__":
    print(name, flush=True)


def mismatches(got: Dict[str, List[List[int]]], expected: Dict[str, List[List[int]]],
               prefix: str) -> List[str]:
  """The runs under `prefix` whose tokens differ from the expected ones (the
  two must hold the same runs)."""
  want = {k: v for k, v in expected.items() if k.startswith(prefix)}
  assert set(got) == set(want), sorted(set(got) ^ set(want))
  return sorted(k for k in want if got[k] != want[k])


def load() -> Dict[str, List[List[int]]]:
  with open(PATH) as f:
    return json.load(f)


def write(runs: Dict[str, List[List[int]]]) -> None:
  old = load() if os.path.exists(PATH) else {}
  old.update(runs)
  with open(PATH, "w") as f:
    f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                               for k, v in sorted(old.items())) + "\n}\n")


def main(argv) -> None:
  import specjax  # pylint: disable=import-outside-toplevel
  specjax.use_compilation_cache()
  runs = {} if "--smollm2" in argv else tiny_runs()
  if "--tiny" not in argv:
    from specjax.io.load import load_model  # pylint: disable=import-outside-toplevel
    runs.update(smollm2_runs(load_model("smollm2-135m")))
  write(runs)
  print(f"wrote {len(runs)} runs to {PATH}")


if __name__ == "__main__":
  main(sys.argv[1:])
