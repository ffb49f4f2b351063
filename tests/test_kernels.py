"""The CPU decode kernels (`specjax.kernels`). The few-row product `rowdot`:
the value of x @ w^T, each row's bits independent of the row count and of the
other rows, a padded tile's real rows only, its gradients and batching, and
the fallback where it is switched off. The decode attention `attention`: its
value against a float64 softmax over each row's view, and each row's bits
independent of the other rows, the row count, the cache's size and the
invisible slots."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.models import transformer

# SmolLM2's MLP-down shape (F = 576 < D = 1,536) and a D that is not a multiple
# of the kernel's 8 lanes (the scalar tail); one weight of each precision.
SHAPES = [(576, 1536), (384, 700)]


@pytest.fixture(scope="module")
def rowdot():
  if not kernels.available():
    # The CI machine and every development machine so far are x86-64 with AVX2
    # and a compiler: there the kernel must build, not be skipped quietly.
    assert not {"avx2", "fma"} <= kernels.cpu_flags(), kernels.unavailable_reason()
    pytest.skip(f"rowdot unavailable: {kernels.unavailable_reason()}")
  return jax.jit(kernels.rowdot)


def _weights(shape, dtype, seed=0):
  return (jax.random.normal(jax.random.PRNGKey(seed), shape) * 0.05).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rowdot_equals_the_product(rowdot, shape, dtype):
  w = _weights(shape, dtype)
  for rows in (1, 5, 16):
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, shape[1]))
    got = np.asarray(rowdot(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    assert got.shape == (rows, shape[0]) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_each_row_has_the_same_bits_in_any_block(rowdot, shape, dtype):
  """Row r of an R-row product equals the one-row product of that row, bit for
  bit, for every R in 1..16 and whatever the other rows hold; negative
  control: a plain XLA dot of the same rows does not (the test can fail)."""
  w = _weights(shape, dtype)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, shape[1]))
  alone = np.stack([np.asarray(rowdot(x[r:r + 1], w))[0] for r in range(16)])
  for rows in range(1, 17):
    block = np.asarray(rowdot(x[:rows], w))
    np.testing.assert_array_equal(block, alone[:rows], err_msg=f"{rows} rows")
  shuffled = np.asarray(rowdot(x[::-1], w))[::-1]
  np.testing.assert_array_equal(shuffled, alone)
  noisy = np.asarray(rowdot(x.at[1:].multiply(1e3), w))[0]
  np.testing.assert_array_equal(noisy, alone[0])


def test_rowdot_computes_only_the_valid_rows(rowdot):
  """`valid` (a traced count): rows [0, valid) as without it, bit for bit, the
  rest zero (the batch-invariant forward's padding rows cost nothing)."""
  del rowdot
  w = _weights(SHAPES[0], "bfloat16")
  x = jax.random.normal(jax.random.PRNGKey(7), (8, SHAPES[0][1]))
  full = np.asarray(kernels.rowdot(x, w))
  part = jax.jit(kernels.rowdot)
  for valid in (0, 1, 5, 8, 11):
    got = np.asarray(part(x, w, jnp.int32(valid)))
    n = min(valid, 8)
    np.testing.assert_array_equal(got[:n], full[:n])
    assert not got[n:].any()


def test_the_plain_dot_is_not_row_invariant_here(rowdot):
  """The control for the test above: XLA's own products of 1 and of 8 rows round
  differently (else the invariance test would prove nothing about rowdot)."""
  w = _weights(SHAPES[0], "float32")
  x = jax.random.normal(jax.random.PRNGKey(2), (8, SHAPES[0][1]))
  dot = jax.jit(lambda x, w: jnp.einsum("rd,fd->rf", x, w))
  one = np.stack([np.asarray(dot(x[r:r + 1], w))[0] for r in range(8)])
  assert not np.array_equal(np.asarray(dot(x, w)), one)
  np.testing.assert_array_equal(np.asarray(rowdot(x, w)),
                                np.stack([np.asarray(rowdot(x[r:r + 1], w))[0] for r in range(8)]))


def test_gradients_and_vmap(rowdot):
  del rowdot
  w = _weights((576, 1536), "float32")
  x = jax.random.normal(jax.random.PRNGKey(3), (3, 1536))
  c = jax.random.normal(jax.random.PRNGKey(6), (3, 576))
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) * c)
  plain = lambda x, w: jnp.einsum("rd,fd->rf", x, w, precision="highest")
  gx, gw = jax.grad(loss(kernels.rowdot), argnums=(0, 1))(x, w)
  ex, ew = jax.grad(loss(plain), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(ex), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(ew), rtol=1e-4, atol=1e-5)
  xs = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 1536))
  got = jax.vmap(kernels.rowdot, in_axes=(0, None))(xs, w)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(kernels.rowdot(xs[1], w)))


def test_transformer_products_take_the_kernel(rowdot):
  """`transformer._dot` routes 1-16 rows of a large weight through the kernel
  (so an AR step's and a verify block's products agree bit for bit) and more
  rows through XLA's products."""
  w = _weights((576, 1536), "float32")
  x = jax.random.normal(jax.random.PRNGKey(5), (3, 8, 1536))  # 24 rows: XLA's
  dot = jax.jit(transformer._dot)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(dot(x[:1, :5], w))[0],
                                np.asarray(rowdot(x[0, :5], w)))
  hlo = jax.jit(transformer._dot).lower(x[:1, :5], w).as_text()  # pylint: disable=protected-access
  assert "specjax_rowdot" in hlo
  assert "specjax_rowdot" not in jax.jit(transformer._dot).lower(x, w).as_text()  # pylint: disable=protected-access


def test_switched_off_keeps_xla_products():
  """SPECJAX_ROWDOT=0: `available()` is False with the reason, and decoding's
  products are XLA's (a fresh process: the setting is read once)."""
  code = ("import jax, jax.numpy as jnp\n"
          "from specjax import kernels\n"
          "from specjax.models import transformer\n"
          "w = jnp.ones((576, 1536)); x = jnp.ones((1, 5, 1536))\n"
          "hlo = jax.jit(transformer._dot).lower(x, w).as_text()\n"
          "print(kernels.available(), kernels.unavailable_reason(), 'specjax_rowdot' in hlo)\n")
  env = dict(os.environ, SPECJAX_ROWDOT="0", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=300).stdout.split("\n")[-2]
  assert out == "False SPECJAX_ROWDOT=0 False"


def _attention_inputs(dtype, rows=6, slots=40, batch=2, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(rows, 9, 64)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, slots, 3, 64)), dtype) for _ in range(2))
  row = jnp.asarray(rng.integers(0, batch, rows), jnp.int32)
  src = jnp.asarray(rng.integers(0, slots, (rows, slots)), jnp.int32)
  vis = jnp.asarray(rng.random((rows, slots)) < 0.7)
  return q, k, v, row, src, vis


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_equals_softmax_over_each_view(rowdot, dtype):
  """Each valid row: softmax(scale q.K) V over its visible view slots (view slot
  n reads cache slot src[n] of the row's batch row), SmolLM2's heads (9 query,
  3 KV, 64 wide); rows past `valid` come back zero."""
  del rowdot
  q, k, v, row, src, vis = _attention_inputs(dtype)
  got = np.asarray(kernels.attention(q, k, v, row, src, vis, jnp.int32(5), 0.125))
  kf, vf = (np.asarray(a.astype(jnp.float32), np.float64) for a in (k, v))
  for p in range(5):
    at = np.asarray(src[p])[np.asarray(vis[p])]
    for h in range(9):
      s = kf[int(row[p]), at, h // 3] @ np.asarray(q[p, h], np.float64) * 0.125
      w = np.exp(s - s.max())
      want = (w / w.sum()) @ vf[int(row[p]), at, h // 3]
      # bfloat16: the weights are rounded to the cache's dtype, as the plain forward does
      np.testing.assert_allclose(got[p, h], want, atol=1e-5 if dtype == "float32" else 5e-3)
  assert not got[5:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_rows_have_the_same_bits_in_any_block(rowdot, dtype):
  """A row alone, in a block with other rows (changed, reordered), over a
  cache twice as large whose extra slots it does not see, or reading the same
  slots through another view: the same bits."""
  del rowdot
  q, k, v, row, src, vis = _attention_inputs(dtype)
  att = jax.jit(kernels.attention, static_argnums=7)
  block = np.asarray(att(q, k, v, row, src, vis, jnp.int32(6), 0.125))
  for p in range(6):
    alone = att(q[p:p + 1], k, v, row[p:p + 1], src[p:p + 1], vis[p:p + 1], jnp.int32(1), 0.125)
    np.testing.assert_array_equal(np.asarray(alone)[0], block[p])
  rev = np.asarray(att(q[::-1].at[1:].multiply(1e3), k, v, row[::-1], src[::-1], vis[::-1],
                       jnp.int32(6), 0.125))
  np.testing.assert_array_equal(rev[0], block[5])
  big = [jnp.concatenate([a, a], axis=1) for a in (k, v)]
  src2 = jnp.concatenate([src, src], axis=1)
  vis2 = jnp.concatenate([vis, jnp.zeros_like(vis)], axis=1)
  np.testing.assert_array_equal(
      np.asarray(att(q, *big, row, src2, vis2, jnp.int32(6), 0.125)), block)
  # the visible slots compacted to the front of the view: the same keys in the same order
  order = np.argsort(~np.asarray(vis), axis=1, kind="stable")
  src3 = np.take_along_axis(np.asarray(src), order, axis=1)
  vis3 = np.take_along_axis(np.asarray(vis), order, axis=1)
  np.testing.assert_array_equal(
      np.asarray(att(q, k, v, row, jnp.asarray(src3), jnp.asarray(vis3), jnp.int32(6), 0.125)),
      block)
