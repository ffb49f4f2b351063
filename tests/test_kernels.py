"""The few-row CPU product (`specjax.kernels.rowdot`): the value of x @ w^T,
each row's bits independent of the row count and of the other rows, its
gradients and batching, and the fallback where it is switched off."""

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
  """`transformer._dot` routes 1-8 rows of a large weight through the kernel
  (so an AR step's and a verify block's products agree bit for bit) and more
  rows through XLA's products."""
  w = _weights((576, 1536), "float32")
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 8, 1536))  # 16 rows: XLA's
  dot = jax.jit(transformer._dot)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(dot(x[:1, :5], w))[0],
                                np.asarray(rowdot(x[0, :5], w)))
  hlo = jax.jit(transformer._dot).lower(x[:1, :5], w).as_text()  # pylint: disable=protected-access
  assert kernels._TARGET in hlo  # pylint: disable=protected-access
  assert kernels._TARGET not in jax.jit(transformer._dot).lower(x, w).as_text()  # pylint: disable=protected-access


def test_switched_off_keeps_xla_products():
  """SPECJAX_ROWDOT=0: `available()` is False with the reason, and decoding's
  products are XLA's (a fresh process: the setting is read once)."""
  code = ("import jax, jax.numpy as jnp\n"
          "from specjax import kernels\n"
          "from specjax.models import transformer\n"
          "w = jnp.ones((576, 1536)); x = jnp.ones((1, 5, 1536))\n"
          "hlo = jax.jit(transformer._dot).lower(x, w).as_text()\n"
          "print(kernels.available(), kernels.unavailable_reason(), kernels._TARGET in hlo)\n")
  env = dict(os.environ, SPECJAX_ROWDOT="0", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=300).stdout.split("\n")[-2]
  assert out == "False SPECJAX_ROWDOT=0 False"
