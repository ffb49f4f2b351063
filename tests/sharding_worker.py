"""Sharded == single-device decoding, run in its own process by tests/test_sharding.py.

The test process has one CPU device; this one forces 8 host devices before
JAX starts, decodes with every method on each mesh shape and on the default
device, and prints one JSON record per comparison
(`specjax.analysis.sharded_identity.check`), then a line `DONE`.

  python tests/sharding_worker.py tiny [METHODS|all [MESHES]]  every drafter on a tiny
      random target (tiny-greedy / tiny-sampled: one setting; METHODS 'ar,eagle',
      MESHES '2x4,1x8')
  python tests/sharding_worker.py ci       the test suite's matrix (below)
  python tests/sharding_worker.py smollm2  the real SmolLM2-135M: AR and prompt lookup
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import json  # pylint: disable=wrong-import-position

import specjax  # pylint: disable=wrong-import-position  (sets XLA_FLAGS first)
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from specjax import sampling as sampling_lib  # pylint: disable=wrong-import-position
from specjax.analysis import sharded_identity  # pylint: disable=wrong-import-position
from specjax.decoding import autoregressive as ar  # pylint: disable=wrong-import-position
from specjax.drafters import eagle  # pylint: disable=wrong-import-position
from specjax.drafters import eagle_tree  # pylint: disable=wrong-import-position
from specjax.drafters import lookahead as la  # pylint: disable=wrong-import-position
from specjax.drafters.draft_model import DraftModel  # pylint: disable=wrong-import-position
from specjax.drafters.layer_skip import LayerSkip  # pylint: disable=wrong-import-position
from specjax.drafters.medusa import (Blockwise, Medusa, MedusaTree, geometric_accuracies,  # pylint: disable=wrong-import-position
                                     tree_from_accuracies)
from specjax.drafters.prompt_lookup import PromptLookup  # pylint: disable=wrong-import-position
from specjax.drafters.replay import AlwaysReject, Replay, replay_params  # pylint: disable=wrong-import-position
from specjax.models import transformer  # pylint: disable=wrong-import-position
from specjax.models.config import tiny_config  # pylint: disable=wrong-import-position

MESHES = ((8, 1), (2, 4), (1, 8))
GREEDY = sampling_lib.GREEDY
SAMPLED = sampling_lib.SamplingConfig(temperature=0.8, top_p=0.9)
# A split contraction sums in another order (~1e-6 in f32 here); a greedy
# divergence is excused only where the reference's top-2 logits are closer.
DELTA = 1e-3

# 6 query / 2 KV heads: like SmolLM2's 9 / 3, the head count divides neither
# 4 nor 8 model devices. Untied LM head: both vocabulary tables are split.
CFG = tiny_config(num_heads=6, num_kv_heads=2, eos_id=2, pad_id=0, tie_embeddings=False)
DCFG = CFG.replace(num_layers=1)
PROMPTS = [[5, 9, 13], [7, 11, 3, 20, 31, 8, 4], [17], [3, 4, 3, 4, 3], [9, 9, 9, 9],
           [1, 6, 3], [40, 41, 40], [50, 51]]
NEW = 16


def emit(rec):
  print(json.dumps(rec), flush=True)


def _scaled(key, cfg):
  p = transformer.init(key, cfg)
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)  # non-uniform outputs


def tiny_methods(params, reference):
  """-> methods(sampling): AR and every drafter, sampling drafters with the target's settings."""
  draft = _scaled(jax.random.key(2), DCFG)
  heads = {"w": 0.3 * jax.random.normal(jax.random.key(3), (3, CFG.dim, CFG.dim)) / np.sqrt(CFG.dim),
           "b": jnp.zeros((3, CFG.dim))}
  choices = tree_from_accuracies(geometric_accuracies([0.6, 0.4, 0.3], 3), 8)

  def head(fused):
    h = eagle.init_head(jax.random.key(9), CFG, fused=fused,
                        vocab=jnp.arange(0, CFG.vocab_size, 2) if fused else None)
    h["fc"] = 0.5 * jax.random.normal(jax.random.key(10), (CFG.dim, 2 * CFG.dim)) / np.sqrt(
        2 * CFG.dim)
    return eagle.prepare(h, params, CFG)

  heads_e, heads_e3 = head(False), head(True)
  look = dict(k=2, window=4, ngram=3, max_candidates=4, pool_size=32)

  def methods(s):
    return [
        ("ar", None, None),
        ("draft_model", DraftModel(k=3, cfg=DCFG, sampling=s), draft),
        ("layer_skip", LayerSkip(k=3, layers=(0,), sampling=s), None),
        ("prompt_lookup", PromptLookup(k=3), None),
        ("replay", Replay(k=4), replay_params(reference)),
        ("always_reject", AlwaysReject(k=2), None),
        ("medusa", Medusa(k=3, sampling=s), heads),
        ("blockwise", Blockwise(k=3, sampling=s), heads),
        ("medusa_tree", MedusaTree(k=3, choices=choices, sampling=s), heads),
        ("eagle", eagle.Eagle(k=3, sampling=s), heads_e),
        ("eagle3", eagle.Eagle(k=3, sampling=s, fused=True), heads_e3),
        ("eagle_tree", eagle_tree.EagleTree(k=3, tree_topk=2, tree_width=2, tree_nodes=6, sampling=s), heads_e),
        ("lookahead", la.Lookahead(**look), None),
        ("lookahead_tree", la.LookaheadTree(**look), None),
    ]
  return methods


def run_tiny(samplings, only=None, meshes=MESHES):
  params = _scaled(jax.random.key(1), CFG)
  reference = ar.generate(params, CFG, PROMPTS, max_new_tokens=NEW).tokens
  methods = tiny_methods(params, reference)
  pick = (lambda s: [m for m in methods(s) if m[0] in only]) if only else methods
  # Greedy: every method on the mesh against single-device AR (one compile less each).
  sharded_identity.check(params, CFG, pick, PROMPTS, meshes, samplings, delta=DELTA,
                         max_new_tokens=NEW, greedy_reference=reference, progress=emit)
  if only and "ar_padded" not in only:
    return
  # A batch that does not divide the data axis runs padded with inert rows.
  for s in samplings:
    ref = ar.generate(params, CFG, PROMPTS, sampling=s, max_new_tokens=NEW, key=5).tokens[:6]
    got = ar.generate(params, CFG, PROMPTS[:6], sampling=s, max_new_tokens=NEW, key=5,
                      mesh=sharded_identity.sharding.make_mesh((8, 1))).tokens
    emit({"method": "ar_padded", "mesh": [8, 1], "sampling": "greedy" if s.greedy else "sampled",
          **sharded_identity.compare_rows(params, CFG, PROMPTS[:6], ref, got, s.greedy, DELTA)})


def run_smollm2():
  from specjax.io.load import load_model  # pylint: disable=import-outside-toplevel
  model = load_model("smollm2-135m")
  params, cfg = model.params, model.cfg
  tok = model.tokenizer
  prompts = [tok.encode_prompt("Repeat after me: the cat sat on the mat, the cat sat on the mat."),
             tok.encode_prompt("Name three colours.")]

  def methods(s):
    del s  # AR: the partition rules on SmolLM2's shapes (drafters: the tiny matrix)
    return [("ar", None, None)]

  sharded_identity.check(params, cfg, methods, prompts, ((1, 8),), (GREEDY, SAMPLED),
                         delta=DELTA, max_new_tokens=12, progress=emit)


def main(argv):
  specjax.use_compilation_cache()
  assert jax.device_count() == 8, jax.devices()
  suite = argv[1] if len(argv) > 1 else "tiny"
  if suite in ("tiny", "tiny-greedy", "tiny-sampled"):
    samplings = {"tiny": (GREEDY, SAMPLED), "tiny-greedy": (GREEDY,),
                 "tiny-sampled": (SAMPLED,)}[suite]
    only = set(argv[2].split(",")) if len(argv) > 2 and argv[2] != "all" else None
    meshes = tuple(tuple(int(n) for n in m.split("x")) for m in argv[3].split(",")) \
        if len(argv) > 3 else MESHES
    run_tiny(samplings, only, meshes)
  elif suite == "ci":
    # The suite's matrix (compile-bound: one program per method, mesh and
    # setting): every method greedy on (2, 4) against single-device AR; AR and
    # a sampled EAGLE tree on all three shapes (exact); a padded batch.
    run_tiny((GREEDY,), None, ((2, 4),))
    run_tiny((SAMPLED,), {"ar", "eagle_tree", "ar_padded"}, MESHES)
  elif suite == "smollm2":
    run_smollm2()
  else:
    raise SystemExit(f"unknown suite {suite!r} (tiny, tiny-greedy, tiny-sampled, ci, smollm2)")
  print("DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv)
