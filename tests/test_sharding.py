"""Sharded decoding equals the single-device run (specjax.sharding).

This process has one CPU device, so the comparisons run in a worker process
with 8 forced host devices (tests/sharding_worker.py): AR and every drafter on
a tiny random target whose head count, like SmolLM2's, divides neither 4 nor
8, on meshes (8, 1), (2, 4) and (1, 8), greedy and sampled; and the real
SmolLM2-135M on (2, 4) and (1, 8). The partition rules themselves are
checked here, on SmolLM2's shapes.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax import distributed
from specjax import sharding
from specjax.models import transformer
from specjax.models.config import ModelConfig

import compile_effort

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding_worker.py")
MESHES = [[8, 1], [2, 4], [1, 8]]
SMOLLM2 = ModelConfig(vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, ffn_dim=1536)


def _run_worker(suite, timeout):
  # the worker forces 8 devices itself
  env = distributed.child_env([os.path.dirname(os.path.dirname(WORKER))])
  if suite != "smollm2":  # tiny programs: compile-bound
    env = compile_effort.unoptimized_env(env)
  proc = subprocess.run([sys.executable, WORKER, suite], env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert proc.returncode == 0 and "DONE" in proc.stdout, (
      f"worker exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_same(records):
  for r in records:
    # greedy: a divergence only at a near tie of the reference; sampled: identical
    assert r["diverged"] == 0, r
    if r["sampling"] == "sampled":
      assert r["status"] == "identical", r


def test_smollm2_partition_specs():
  """Vocab, MLP intermediate and attention input width over `model`: every
  matrix splits evenly over 4 and 8 devices although 9 / 3 heads do not."""
  shapes = jax.eval_shape(lambda: transformer.init(jax.random.key(0), SMOLLM2))
  for m in (4, 8):
    specs = jax.tree_util.tree_map_with_path(
        lambda path, x: sharding.param_spec(sharding._name(path), x.shape, m), shapes)  # pylint: disable=protected-access
    layer = specs["layers"][0]
    assert specs["embed"] == P("model", None)
    assert layer["wqkv"] == P(None, "model")  # (960, 576): the 576-wide input
    assert layer["wo"] == P(None, "model")
    assert layer["w_gate_up"] == P("model", None)
    assert layer["w_down"] == P(None, "model")
    assert layer["attn_norm"] == P() and specs["final_norm"] == P()
  # a dimension that does not divide falls back, then replicates
  assert sharding.param_spec("embed", (49155, 576), 8) == P(None, "model")
  assert sharding.param_spec("wqkv", (960, 577), 8) == P()


def test_mesh_shapes_and_padding():
  assert sharding.parse_mesh_shape("") is None and sharding.parse_mesh_shape(None) is None
  assert sharding.parse_mesh_shape("2,4") == (2, 4) and sharding.parse_mesh_shape("8") == (8, 1)
  for bad in ("a,b", "0,4", "1,2,3"):
    with pytest.raises(ValueError, match="mesh"):
      sharding.parse_mesh_shape(bad)
  with pytest.raises(ValueError, match="needs 8 devices"):
    sharding.make_mesh((2, 4), jax.devices()[:1])
  mesh = sharding.make_mesh((1, 1))
  assert sharding.pad_requests([[1], [2]], 5, None, mesh) == ([[1], [2]], 5, None)


class _FakeMesh:
  shape = {"data": 4, "model": 1}


def test_padding_rows_are_inert_and_keep_request_ids_unique():
  prompts, limits, ids = sharding.pad_requests([[1, 2], [3]], [5, 6], [10, 3], _FakeMesh())
  assert prompts == [[1, 2], [3], [1, 2], [1, 2]]
  assert limits == [5, 6, 1, 1]
  assert np.asarray(ids).tolist() == [10, 3, 11, 12]


def test_a_one_device_mesh_gives_the_same_tokens():
  """The mesh code path (placement, padding, the placed loop state) in this
  one-device process; the multi-device comparisons run in the worker."""
  from specjax.decoding import autoregressive as ar  # pylint: disable=import-outside-toplevel
  from specjax.decoding import speculative as sp  # pylint: disable=import-outside-toplevel
  from specjax.drafters.prompt_lookup import PromptLookup  # pylint: disable=import-outside-toplevel
  from specjax.models.config import tiny_config  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(eos_id=-1, pad_id=0)
  params = transformer.init(jax.random.key(1), cfg)
  prompts = [[5, 9, 13], [7, 11, 3, 20], [17]]
  mesh = sharding.make_mesh((1, 1))
  assert jax.config.jax_threefry_partitionable
  want = ar.generate(params, cfg, prompts, max_new_tokens=8).tokens
  assert ar.generate(params, cfg, prompts, max_new_tokens=8, mesh=mesh).tokens == want
  got = sp.generate(params, cfg, PromptLookup(k=2), prompts, max_new_tokens=8, mesh=mesh)
  assert got.tokens == want


METHODS = ("ar", "draft_model", "layer_skip", "prompt_lookup", "replay", "always_reject",
           "medusa", "blockwise", "medusa_tree", "eagle", "eagle3", "eagle_tree", "lookahead",
           "lookahead_tree")


# Compile-bound: one program per method, mesh shape and sampling setting
# (~15-20 s each on 2 cores). The suite runs `ci`: every method greedy on
# (2, 4) against single-device AR, AR and a sampled EAGLE tree on (8, 1),
# (2, 4) and (1, 8) (exact token equality), and a padded batch. The full matrix
# (every method x every shape x both settings, ~85 programs, tens of minutes) runs
# with SPECJAX_FULL_SHARDING=1.
FULL = os.environ.get("SPECJAX_FULL_SHARDING") == "1"


@pytest.mark.slow
def test_tiny_sharded_equals_single_device():
  records = _run_worker("ci", timeout=3600)
  seen = {(r["method"], tuple(r["mesh"]), r["sampling"]) for r in records}
  want = {(m, (2, 4), "greedy") for m in METHODS}
  want |= {(m, tuple(mesh), "sampled") for m in ("ar", "eagle_tree") for mesh in MESHES}
  want |= {("ar_padded", (8, 1), s) for s in ("greedy", "sampled")}
  assert seen == want, seen ^ want
  _assert_same(records)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full matrix: SPECJAX_FULL_SHARDING=1 (~85 compiles)")
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_tiny_every_drafter_on_every_mesh(sampling):
  records = _run_worker(f"tiny-{sampling}", timeout=5400)
  seen = {(r["method"], tuple(r["mesh"]), r["sampling"]) for r in records}
  assert seen == {(m, tuple(mesh), sampling) for m in METHODS for mesh in MESHES} | {
      ("ar_padded", (8, 1), sampling)}
  _assert_same(records)


@pytest.mark.slow
def test_smollm2_sharded_equals_single_device():
  """The real model (9 query / 3 KV heads) on (1, 8), AR greedy and sampled:
  vocabulary, MLP and the attention input split 8 ways (the drafters' loops
  are checked on the tiny target)."""
  records = _run_worker("smollm2", timeout=3600)
  seen = {(r["method"], tuple(r["mesh"]), r["sampling"]) for r in records}
  assert seen == {("ar", (1, 8), s) for s in ("greedy", "sampled")}
  _assert_same(records)
