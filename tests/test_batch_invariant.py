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

import json
import os
import platform
import warnings

import jax
import pytest

from specjax import kernels
from specjax.analysis import bitwise
from specjax.analysis.bitwise import RAGGED, chain_mismatches, tree_mismatches
from specjax.models import invariant, transformer
from specjax.models.config import ModelConfig

pytestmark = pytest.mark.slow  # ~100 programs of SmolLM2-sized layers

PLATFORM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "batch_invariant_platform.json")


def smollm2_shapes(dtype: str, invariant: bool, tile: int = 0) -> ModelConfig:
  """SmolLM2-135M's matrix shapes with 2 layers."""
  return ModelConfig(vocab_size=49152, dim=576, num_layers=2, num_heads=9, num_kv_heads=3,
                     head_dim=64, ffn_dim=1536, rope_theta=100000.0, max_seq_len=2048,
                     dtype=dtype, batch_invariant=invariant, invariant_tile=tile)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_shaped_verify_blocks_and_trees_equal_one_token_steps(dtype):
  cfg = smollm2_shapes(dtype, True)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, (24,)) == []
  assert chain_mismatches(params, cfg, RAGGED) == []
  assert tree_mismatches(params, cfg, (24,)) == []
  assert tree_mismatches(params, cfg, RAGGED) == []


@pytest.mark.parametrize("dtype,tile", [("float32", 5), ("bfloat16", 16)])
def test_another_tile_size_is_batch_invariant_too(dtype, tile):
  """Another `invariant_tile` than the precision's default (float32 at 5 rows,
  k + 1 for k = 4, not a multiple of the SIMD width; bfloat16 at 16, its
  default before session 27): ragged B = 4 blocks of widths 1..17 span
  several tiles, rows at every position of a tile."""
  cfg = smollm2_shapes(dtype, True, tile=tile)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, RAGGED) == []
  assert tree_mismatches(params, cfg, RAGGED) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_control_default_forward_is_not_batch_invariant(dtype):
  cfg = smollm2_shapes(dtype, False)
  params = transformer.init(jax.random.key(0), cfg)
  assert chain_mismatches(params, cfg, RAGGED, widths=(5, 9, 17)), \
      "the default forward matched one-token steps: the control proves nothing"


SMOLLM2_WIDTHS = bitwise.FEW_WIDTHS


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
  simd = sorted(f for f in kernels.cpu_flags() if f.startswith(("avx", "sse4", "fma", "amx")))
  import jaxlib  # pylint: disable=import-outside-toplevel
  return {"jaxlib": jaxlib.__version__, "machine": platform.machine(),
          "backend": jax.default_backend(), "formulation": invariant.formulation(),
          "cpu_simd_flags": simd}


def test_platform_is_the_one_the_guarantee_was_established_on():
  """Bitwise batch invariance is a property of the compiled kernels: it was
  established (the tests above) on the platforms recorded in
  batch_invariant_platform.json, each with the invariant forward's
  formulation (`invariant.formulation()`: with or without specjax's CPU
  kernels) and the session that checked it.
  Another jaxlib or CPU may lower the same program differently; the tests
  above then say whether it still holds, and this test says loudly that the
  ground moved."""
  with open(PLATFORM_FILE) as f:
    recorded = json.load(f)["established_on"]
  assert recorded and all(set(r) >= {"jaxlib", "backend", "formulation", "cpu_simd_flags",
                                     "session"}
                          for r in recorded)
  now = current_platform()
  if not any(all(r.get(k) == v for k, v in now.items()) for r in recorded):
    nearest = min(recorded, key=lambda r: sum(r.get(k) != v for k, v in now.items()))
    changed = {k: (nearest.get(k), v) for k, v in now.items() if nearest.get(k) != v}
    warnings.warn(f"batch invariance was established on {len(recorded)} platform(s), the "
                  f"nearest {nearest}; this platform differs in {changed}: the bitwise "
                  "guarantee is re-checked by the tests of this module, not inherited",
                  UserWarning)
