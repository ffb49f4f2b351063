"""Bit-for-bit batch invariance of the decode forward (`ModelConfig.batch_invariant`).

With the setting on, the logits of every row of a verify block (widths 1..17)
and of every node of a tree equal, bit for bit, the logits of the same
position decoded one token at a time, in float32 and bfloat16, for B = 1 and
a ragged B = 4 (rows at different cache fill levels). Checked on a random
model with SmolLM2's matrix shapes (the tiny test target is below the
row-count thresholds where XLA switches formulation and would prove nothing)
and on SmolLM2-135M itself (the ragged B = 4, widths {1, 2, 5, 8, 9, 16,
17} and a tree), at the precision's default tile and (random model) at
another tile size. Negative control: with the setting off the same
comparison finds mismatches, on both.

The guarantee is a property of the compiled code: `test_platform_is_the_one_
the_guarantee_was_established_on` records the jaxlib version and CPU flags it
was established on and says so loudly when they change.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import trees
from specjax.models import cache as cache_lib
from specjax.models import transformer
from specjax.models.config import ModelConfig

pytestmark = pytest.mark.slow  # ~100 programs of SmolLM2-sized layers

WIDTHS = tuple(range(1, 18))
# a tree of 8 nodes over 3 depths (parents in topological order)
PARENT = (-1, -1, 0, 0, 1, 2, 2, 4)
PLATFORM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "batch_invariant_platform.json")


def smollm2_shapes(dtype: str, invariant: bool, tile: int = 0) -> ModelConfig:
  """SmolLM2-135M's matrix shapes with 2 layers."""
  return ModelConfig(vocab_size=49152, dim=576, num_layers=2, num_heads=9, num_kv_heads=3,
                     head_dim=64, ffn_dim=1536, rope_theta=100000.0, max_seq_len=2048,
                     dtype=dtype, batch_invariant=invariant, invariant_tile=tile)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill(params, cfg, tokens, lengths, num_slots_like):
  cache = cache_lib.init_cache(cfg, tokens.shape[0], num_slots_like.shape[0])
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  _, _, cache = transformer.forward(params, cfg, tokens, pos, cache, batch_invariant=False)
  return cache.with_length(lengths)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _block(params, cfg, cache, tokens, positions, mask):
  return transformer.forward(params, cfg, tokens, positions, cache, mask)[0]


@jax.jit
def _tree_layout(length, parent):
  """RoPE positions (the root's + depth) and the ancestor-only mask of [root, nodes]."""
  b, n = length.shape[0], parent.shape[0]
  parent = jnp.broadcast_to(parent, (b, n))
  dep = trees.depths(parent)
  positions = length[:, None] + jnp.concatenate([jnp.zeros((b, 1), jnp.int32), dep], 1)
  return positions, trees.ancestor_mask(parent)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _step(params, cfg, cache, tokens):
  logits, _, cache = transformer.forward(params, cfg, tokens,
                                         transformer.chain_positions(cache, 1), cache)
  return logits[:, 0], cache


def _setup(params, cfg, prompt_lengths, seed=0, num_slots=96):
  rng = np.random.default_rng(seed)
  b = len(prompt_lengths)
  width = max(prompt_lengths)
  prompts = rng.integers(3, cfg.vocab_size, (b, width)).astype(np.int32)
  cache = _prefill(params, cfg, prompts, np.asarray(prompt_lengths, np.int32),
                   np.zeros((num_slots,), np.float32))
  # numpy: slicing it outside jit compiles nothing
  cont = rng.integers(3, cfg.vocab_size, (b, max(WIDTHS))).astype(np.int32)
  return cache, cont


def chain_mismatches(params, cfg, prompt_lengths, widths=WIDTHS):
  """[(width, max |difference|)] where a verify block's logits differ from
  one-token steps over the same tokens."""
  cache, cont = _setup(params, cfg, prompt_lengths)
  steps, c = [], cache
  for i in range(max(widths)):
    lg, c = _step(params, cfg, c, cont[:, i:i + 1])
    steps.append(np.asarray(lg))
  steps = np.stack(steps, 1)
  bad = []
  for w in widths:
    got = np.asarray(_block(params, cfg, cache, cont[:, :w],
                            np.asarray(cache.length)[:, None] + np.arange(w, dtype=np.int32),
                            None))
    if not np.array_equal(got, steps[:, :w]):
      bad.append((w, float(np.max(np.abs(got - steps[:, :w])))))
  return bad


def tree_mismatches(params, cfg, prompt_lengths):
  """Nodes (and the root) of a tree whose verify logits differ from one-token
  steps along the node's root -> node path."""
  cache, cont = _setup(params, cfg, prompt_lengths, seed=1)
  b, n = len(prompt_lengths), len(PARENT)
  fed = cont[:, :n + 1]  # [root, node 0, ..., node n - 1]
  positions, mask = _tree_layout(cache.length, np.asarray(PARENT, np.int32))
  got = np.asarray(_block(params, cfg, cache, fed, positions, mask))
  bad = []
  for j in range(-1, n):  # -1: the root
    path, node = [], j
    while node >= 0:
      path.append(node + 1)
      node = PARENT[node]
    path = [0] + path[::-1]
    c = cache
    for f in path:
      lg, c = _step(params, cfg, c, fed[:, f:f + 1])
    if not np.array_equal(got[:, j + 1], np.asarray(lg)):
      bad.append((j, float(np.max(np.abs(got[:, j + 1] - np.asarray(lg))))))
  return bad


RAGGED = (40, 23, 31, 9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_shaped_verify_blocks_and_trees_equal_one_token_steps(dtype):
  cfg = smollm2_shapes(dtype, True)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, (24,)) == []
  assert chain_mismatches(params, cfg, RAGGED) == []
  assert tree_mismatches(params, cfg, (24,)) == []
  assert tree_mismatches(params, cfg, RAGGED) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_another_tile_size_is_batch_invariant_too(dtype):
  """`invariant_tile` = 5 (k + 1 for k = 4: a B = 1 chain verify in one tile, not
  a multiple of the SIMD width): ragged B = 4 blocks of widths 1..17 span 1 to
  14 tiles, rows at every position of a tile."""
  cfg = smollm2_shapes(dtype, True, tile=5)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, RAGGED) == []
  assert tree_mismatches(params, cfg, RAGGED) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_control_default_forward_is_not_batch_invariant(dtype):
  cfg = smollm2_shapes(dtype, False)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, RAGGED, widths=(5, 9, 17)), \
      "the default forward matched one-token steps: the control proves nothing"


SMOLLM2_WIDTHS = (1, 2, 5, 8, 9, 16, 17)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_verify_blocks_and_a_tree_equal_one_token_steps(smollm2, dtype):
  params = smollm2.params
  if dtype != smollm2.cfg.dtype:
    params = jax.tree.map(lambda x: x.astype(dtype), params)
  cfg = smollm2.cfg.replace(dtype=dtype, batch_invariant=True)
  assert chain_mismatches(params, cfg, RAGGED, SMOLLM2_WIDTHS) == []
  assert tree_mismatches(params, cfg, RAGGED) == []
  # negative control: the default forward on the same blocks
  off = chain_mismatches(params, cfg.replace(batch_invariant=False), RAGGED, (9,))
  assert off, "SmolLM2's default forward matched one-token steps: the control proves nothing"


def current_platform() -> dict:
  flags = []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          flags = sorted(line.split(":", 1)[1].split())
          break
  except OSError:
    pass
  simd = [f for f in flags if f.startswith(("avx", "sse4", "fma", "amx"))]
  import jaxlib  # pylint: disable=import-outside-toplevel
  return {"jaxlib": jaxlib.__version__, "machine": platform.machine(),
          "backend": jax.default_backend(), "cpu_simd_flags": simd}


def test_platform_is_the_one_the_guarantee_was_established_on():
  """Bitwise batch invariance is a property of the compiled kernels: it was
  established (the tests above) on the platforms recorded in
  batch_invariant_platform.json, each with the session that checked it.
  Another jaxlib or CPU may lower the same program differently; the tests
  above then say whether it still holds, and this test says loudly that the
  ground moved."""
  with open(PLATFORM_FILE) as f:
    recorded = json.load(f)["established_on"]
  assert recorded and all(set(r) >= {"jaxlib", "backend", "cpu_simd_flags", "session"}
                          for r in recorded)
  now = current_platform()
  if not any(all(r.get(k) == v for k, v in now.items()) for r in recorded):
    nearest = min(recorded, key=lambda r: sum(r.get(k) != v for k, v in now.items()))
    changed = {k: (nearest.get(k), v) for k, v in now.items() if nearest.get(k) != v}
    warnings.warn(f"batch invariance was established on {len(recorded)} platform(s), the "
                  f"nearest {nearest}; this platform differs in {changed}: the bitwise "
                  "guarantee is re-checked by the tests of this module, not inherited",
                  UserWarning)
