"""Bit-for-bit comparison of verify blocks with one-token decode steps.

A speculative run scores k + 1 tokens (or a tree's nodes) in one forward; AR
decodes them one at a time. With `ModelConfig.batch_invariant` every row of
the block must give the very logits of the one-token step at the same
position. `chain_mismatches` and `tree_mismatches` check that on random
prompts and continuations at given cache fill levels (a ragged batch: rows at
different lengths) and return where it fails, so a test, or a user on a new
CPU, jaxlib or tile size, can see whether the guarantee holds there
(`tests/test_batch_invariant.py`; `experiments/invariance.py
--config.parts=bitwise` on SmolLM2).
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import trees
from specjax.models import cache as cache_lib
from specjax.models import transformer

WIDTHS = tuple(range(1, 18))  # chain verify widths checked by default
# fewer widths for a real model (30 layers): 1, and both sides of 8 and 16 rows
FEW_WIDTHS = (1, 2, 5, 8, 9, 16, 17)
# a tree of 8 nodes over 3 depths (parents in topological order)
PARENT = (-1, -1, 0, 0, 1, 2, 2, 4)
RAGGED = (40, 23, 31, 9)  # a ragged B = 4: each row's prompt length


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


def _setup(params, cfg, prompt_lengths, seed, num_slots, width):
  rng = np.random.default_rng(seed)
  b = len(prompt_lengths)
  prompts = rng.integers(3, cfg.vocab_size, (b, max(prompt_lengths))).astype(np.int32)
  cache = _prefill(params, cfg, prompts, np.asarray(prompt_lengths, np.int32),
                   np.zeros((num_slots,), np.float32))
  # numpy: slicing it outside jit compiles nothing
  cont = rng.integers(3, cfg.vocab_size, (b, width)).astype(np.int32)
  return cache, cont


def chain_mismatches(params, cfg, prompt_lengths: Sequence[int],
                     widths: Sequence[int] = WIDTHS, num_slots: int = 96
                     ) -> List[Tuple[int, float]]:
  """[(width, max |difference|)] for each chain verify width whose block
  logits differ from one-token steps over the same tokens (empty: every
  width matched bit for bit)."""
  cache, cont = _setup(params, cfg, prompt_lengths, 0, num_slots, max(widths))
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


def tree_mismatches(params, cfg, prompt_lengths: Sequence[int],
                    parent: Sequence[int] = PARENT, num_slots: int = 96
                    ) -> List[Tuple[int, float]]:
  """[(node, max |difference|)] for the nodes (-1: the root) of a tree whose
  verify logits differ from one-token steps along the node's root -> node path."""
  cache, cont = _setup(params, cfg, prompt_lengths, 1, num_slots, max(WIDTHS))
  n = len(parent)
  fed = cont[:, :n + 1]  # [root, node 0, ..., node n - 1]
  positions, mask = _tree_layout(cache.length, np.asarray(parent, np.int32))
  got = np.asarray(_block(params, cfg, cache, fed, positions, mask))
  bad = []
  for j in range(-1, n):  # -1: the root
    path, node = [], j
    while node >= 0:
      path.append(node + 1)
      node = parent[node]
    path = [0] + path[::-1]
    c = cache
    for f in path:
      lg, c = _step(params, cfg, c, fed[:, f:f + 1])
    if not np.array_equal(got[:, j + 1], np.asarray(lg)):
      bad.append((j, float(np.max(np.abs(got[:, j + 1] - np.asarray(lg))))))
  return bad
