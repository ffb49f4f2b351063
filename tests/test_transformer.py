"""The pure-functional decoder and its KV cache, on a tiny random model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import cache as cache_lib
from specjax.models import invariant
from specjax.models import transformer
from specjax.models.config import tiny_config

CFG = tiny_config()
S = 32  # cache slots used throughout (one compiled shape)
forward = jax.jit(transformer.forward,
                  static_argnames=("cfg", "layers", "hidden_layers", "compute_logits"))


@pytest.fixture(scope="module")
def params():
  p = transformer.init(jax.random.key(0), CFG)
  # Sharper than a default init, so that attention to a wrong slot changes logits.
  return jax.tree.map(lambda x: x * 2.0 if x.ndim == 2 else x, p)


def poisoned_cache(batch, length=0):
  """A cache whose every slot holds garbage (NaN keys, 1e4 values): only what a
  forward writes may ever be attended to."""
  c = cache_lib.init_cache(CFG, batch, S)
  return c.replace(k=tuple(jnp.full_like(k, jnp.nan) for k in c.k),
                   v=tuple(jnp.full_like(v, 1e4) for v in c.v),
                   length=jnp.full((batch,), length, jnp.int32))


def tokens_for(key, b, t):
  return jax.random.randint(jax.random.key(key), (b, t), 3, CFG.vocab_size, dtype=jnp.int32)


# A block of T tokens and T one-token steps group the f32 reductions differently
# (GEMM vs GEMV), so logits agree to rounding, not bitwise (the bitwise mode is
# tests/test_batch_invariant.py). The tiny model's logits reach ~20 and the
# differences measured up to 2.4e-5 (AMD EPYC; 1e-5 elsewhere): 1e-4 absolute
# is still ~1e3 below what a wrong position, mask or cache slot changes (>0.1).
BLOCK_ATOL = 1e-4


def full_forward(params, toks):
  b, t = toks.shape
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  logits, hidden, _ = forward(params, CFG, toks, pos, poisoned_cache(b))
  return logits, hidden


def test_prefill_then_steps_equals_full_forward(params):
  toks = tokens_for(1, 2, 12)
  ref, _ = full_forward(params, toks)
  c = poisoned_cache(2)
  logits, _, c = forward(params, CFG, toks[:, :5], transformer.chain_positions(c, 5), c)
  outs = [logits]
  for t in range(5, 12):
    l, _, c = forward(params, CFG, toks[:, t:t + 1], transformer.chain_positions(c, 1), c)
    outs.append(l)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), ref, atol=BLOCK_ATOL, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(ref)))
  np.testing.assert_array_equal(c.length, [12, 12])


def test_block_of_t_equals_t_single_steps_at_ragged_offsets(params):
  """Verification's premise: one forward over T tokens == T one-token steps,
  each row at its own fill level."""
  toks = tokens_for(2, 3, 16)
  lengths = jnp.array([3, 7, 10], jnp.int32)
  base = poisoned_cache(3)
  _, _, base = forward(params, CFG, toks, transformer.chain_positions(base, 16), base)
  base = base.with_length(lengths)  # rows now hold ragged prefixes; the rest is stale
  new = tokens_for(3, 3, 5)
  block_logits, block_hidden, block_cache = forward(
      params, CFG, new, transformer.chain_positions(base, 5), base)
  c = base
  steps = []
  for t in range(5):
    l, _, c = forward(params, CFG, new[:, t:t + 1], transformer.chain_positions(c, 1), c)
    steps.append(l)
  np.testing.assert_allclose(block_logits, jnp.concatenate(steps, 1), atol=BLOCK_ATOL, rtol=1e-5)
  np.testing.assert_array_equal(block_cache.length, lengths + 5)
  # And each row equals an independent full forward over its own prefix + block.
  for b in range(3):
    seq = jnp.concatenate([toks[b:b + 1, :lengths[b]], new[b:b + 1]], axis=1)
    ref, _ = full_forward(params, seq)
    np.testing.assert_allclose(block_logits[b], ref[0, -5:], atol=BLOCK_ATOL, rtol=1e-5)


def test_rollback_is_a_length_change(params):
  """Writing rejected guesses then moving the fill level back leaves the model
  exactly where it was: stale slots are never read."""
  toks = tokens_for(4, 1, 8)
  c = poisoned_cache(1)
  _, _, c = forward(params, CFG, toks, transformer.chain_positions(c, 8), c)
  junk = tokens_for(5, 1, 4)
  _, _, after_junk = forward(params, CFG, junk, transformer.chain_positions(c, 4), c)
  rolled = after_junk.with_length(c.length)
  nxt = tokens_for(6, 1, 2)
  a, _, _ = forward(params, CFG, nxt, transformer.chain_positions(c, 2), c)
  b, _, _ = forward(params, CFG, nxt, transformer.chain_positions(rolled, 2), rolled)
  np.testing.assert_allclose(a, b, atol=1e-6)


def test_stale_slots_are_masked_negative_control(params):
  """The poison is strong enough to matter: attending to one stale slot changes
  the output (so the tests above would catch a mask that leaks)."""
  toks = tokens_for(7, 1, 6)
  c = poisoned_cache(1)
  _, _, c = forward(params, CFG, toks, transformer.chain_positions(c, 6), c)
  leaked = c.with_length(c.length + 1)  # pretend one stale slot is valid
  nxt = tokens_for(8, 1, 1)
  ok, _, _ = forward(params, CFG, nxt, transformer.chain_positions(c, 1), c)
  bad, _, _ = forward(params, CFG, nxt, transformer.chain_positions(c, 1), leaked)
  assert not np.allclose(ok, bad, atol=1e-3)


def test_tree_mask_matches_each_branch_as_a_chain(params):
  """Ancestor-only mask: a two-branch tree in one forward gives each branch the
  logits it gets as a plain chain."""
  prefix = tokens_for(9, 1, 6)
  c = poisoned_cache(1)
  _, _, c = forward(params, CFG, prefix, transformer.chain_positions(c, 6), c)
  # Nodes: 0 root; 1 child of 0; 2 child of 1 (branch A); 3 child of 0; 4 child of 3 (branch B)
  nodes = jnp.array([[10, 11, 12, 13, 14]], jnp.int32)
  parent = [-1, 0, 1, 0, 3]
  depth = [0, 1, 2, 1, 2]
  mask = np.zeros((5, 5), bool)
  for i in range(5):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  positions = c.length[:, None] + jnp.array(depth)[None]
  tree_logits, _, _ = forward(params, CFG, nodes, positions, c, jnp.asarray(mask))
  for branch in ([0, 1, 2], [0, 3, 4]):
    chain = nodes[:, branch]
    ref, _, _ = forward(params, CFG, chain, transformer.chain_positions(c, 3), c)
    np.testing.assert_allclose(tree_logits[:, branch], ref, atol=BLOCK_ATOL, rtol=1e-5)


def test_inactive_rows_write_nothing(params):
  toks = tokens_for(10, 2, 4)
  c = poisoned_cache(2)
  _, _, c = forward(params, CFG, toks, transformer.chain_positions(c, 4), c)
  active = jnp.array([True, False])
  _, _, c2 = forward(params, CFG, toks[:, :2], transformer.chain_positions(c, 2), c,
                     active=active)
  np.testing.assert_array_equal(c2.length, [6, 4])
  for k_old, k_new in zip(c.k, c2.k):
    np.testing.assert_array_equal(np.asarray(k_old[1]), np.asarray(k_new[1]))
    assert not np.array_equal(np.asarray(k_old[0]), np.asarray(k_new[0]))


def test_writes_past_the_last_slot_are_dropped_not_clamped(params):
  """dynamic_update_slice would clamp the start and overwrite valid entries;
  the scatter drops out-of-range writes instead."""
  toks = tokens_for(11, 1, S)
  c = poisoned_cache(1)
  _, _, full = forward(params, CFG, toks, transformer.chain_positions(c, S), c)
  near_end = full.with_length(jnp.array([S - 1]))
  _, _, after = forward(params, CFG, toks[:, :3], transformer.chain_positions(near_end, 3),
                        near_end)
  for k_old, k_new in zip(full.k, after.k):
    np.testing.assert_array_equal(np.asarray(k_old[:, :S - 1]), np.asarray(k_new[:, :S - 1]))


def test_capacity_check_names_the_problem():
  with pytest.raises(ValueError, match="cache slots"):
    cache_lib.check_capacity(64, prompt_len=40, max_new_tokens=20, block=5)
  cache_lib.check_capacity(64, prompt_len=40, max_new_tokens=19, block=5)


def test_layer_subset_and_hidden_taps(params):
  toks = tokens_for(12, 1, 4)
  c = poisoned_cache(1)
  pos = transformer.chain_positions(c, 4)
  logits, final, _ = forward(params, CFG, toks, pos, c)
  _, taps, _ = forward(params, CFG, toks, pos, c, hidden_layers=(0, 1, CFG.num_layers))
  assert taps.shape == (1, 4, 3 * CFG.dim)
  np.testing.assert_allclose(taps[..., 2 * CFG.dim:], final, atol=1e-6)
  skip_logits, _, skip_cache = forward(params, CFG, toks, pos, c, layers=(0,))
  assert not np.allclose(skip_logits, logits, atol=1e-3)
  # Skipped layer 1 wrote nothing: its slots still hold the poison.
  assert np.all(np.isnan(np.asarray(skip_cache.k[1])))
  none, feats, _ = forward(params, CFG, toks, pos, c, compute_logits=False)
  assert none is None
  np.testing.assert_allclose(feats, final, atol=1e-6)


def test_bf16_forward_tracks_f32(params):
  cfg16 = CFG.replace(dtype="bfloat16")
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  toks = tokens_for(13, 1, 6)
  c32 = cache_lib.init_cache(CFG, 1, S)
  c16 = cache_lib.init_cache(cfg16, 1, S)
  pos = transformer.chain_positions(c32, 6)
  l32, _, _ = forward(params, CFG, toks, pos, c32)
  l16, _, _ = forward(p16, cfg16, toks, pos, c16)
  assert l16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(l32 - l16))) < 0.1 * float(jnp.max(jnp.abs(l32)))


def test_config_validation():
  with pytest.raises(ValueError, match="num_kv_heads"):
    tiny_config(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="dtype"):
    tiny_config(dtype="float16")
  for tile in (-1, 257):
    with pytest.raises(ValueError, match="invariant_tile must be 0"):
      tiny_config(batch_invariant=True, invariant_tile=tile)


def test_invariant_tile_sets_the_rows_per_tile():
  assert invariant.tile_rows("float32") == invariant.TILES[jnp.dtype("float32")]
  assert invariant.tile_rows("bfloat16", 5) == 5
  with pytest.raises(ValueError, match="float32 and bfloat16"):
    invariant.tile_rows("float16", 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_row_products_match_the_plain_product(dtype):
  """The few-row paths for 1-16 rows (`kernels.rowdot` for up to 8 where it
  runs, the fused reduction padded to a power of two) equal x @ w^T on a
  weight large enough to take them."""
  w = jax.random.normal(jax.random.PRNGKey(0), (1024, 256)).astype(dtype)
  assert w.size >= transformer.SMALL_ROWS_MIN_WEIGHT
  for shape in [(1, 1), (1, 2), (1, 3), (2, 3), (1, 5), (4, 4), (1, 16), (3, 7)]:
    x = jax.random.normal(jax.random.PRNGKey(sum(shape)), (*shape, 256))
    got = jax.jit(transformer._dot)(x, w)  # pylint: disable=protected-access
    want = jnp.einsum("...d,fd->...f", x.astype(w.dtype).astype(jnp.float32),
                      w.astype(jnp.float32), precision="highest")
    assert got.shape == (*shape, 1024) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
