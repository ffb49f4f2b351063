"""CPU kernels for what decoding spends its time in: a few rows times a weight
matrix (`rowdot`, source in `rowdot.cc`) and a few queries' attention over the
KV cache (`attention`, source in `attention.cc`; the batch-invariant forward's:
XLA CPU ran its few-row attention einsums at ~100 us a layer for one query over
192 slots, on every row of a padded tile).

Decode-time forwards multiply a few rows (an AR step, a (k + 1)-token verify
block) by every weight matrix. XLA CPU streams the weights near the memory's
bandwidth for one float32 row (GEMV), but has no kernel that does so for 2-16
rows: on a 2-core AVX2 EPYC (session 35), the tied LM head (49,152 x 576,
float32) costs 3.5 ms for one row and 5.6 / 6.8 ms for 3 / 5 rows in the fused
multiply + reduction form (XLA's dot: 8.9 / 9.5 ms; its YNNPACK, XNNPACK and
oneDNN paths through `XLA_FLAGS`, and weights packed in 8-, 16- or 32-column
panels: 7.6-14 ms at 5 rows), so a 5-token verify forward cost ~1.8 AR steps
and every speculative method paid it. `rowdot` loads each weight vector once
and multiplies it into every row's accumulator (up to 8 rows a pass): 3.6 /
4.3 / 4.6 ms for 1 / 3 / 5 rows there; the whole SmolLM2 forward of 5 tokens
42.7 -> 35.6 ms in float32, and bfloat16 weights (converted in registers, half
the bytes) make bfloat16 the fastest AR precision (21.5 ms a step against
float32's 23.8; XLA's bfloat16 step: 28-33 ms).

Each output element is computed the same way whatever the row count and the
other rows (eight lanes of partial sums, combined in one fixed order; threads
split columns, never a sum): a row's result is bit for bit the same in an AR
step and in a verify block (`tests/test_kernels.py`).

`attention` is row-invariant the same way (fixed-order sums, the invisible
slots skipped), so a query's result depends on its own view of the cache only.

The kernels are compiled from source on first use with the machine's C++
compiler (`CXX`, else `c++`) against jaxlib's FFI headers, for x86-64 CPUs with
AVX2 and FMA, into `SPECJAX_KERNEL_CACHE` (default `~/.cache/specjax/kernels`),
keyed by the source, the flags, the compiler and jaxlib. Where it cannot be
built (another CPU, no compiler) or `SPECJAX_ROWDOT=0` (both kernels),
`available()` is False and callers keep XLA's forms; the reason is in
`unavailable_reason()`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("rowdot.cc", "attention.cc"))
_HEADERS = (Path(__file__).with_name("common.h"),)
_TARGETS = {"specjax_rowdot": "SpecjaxRowDot", "specjax_attention": "SpecjaxAttention"}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-ffp-contract=off")
# Rows decoding sends to the kernel (a weight chunk stays in the L1 cache while
# every group of 8 rows passes over it, so 9-16 rows read the weights from
# memory once too; session 36, bfloat16 LM head: 9 / 12 rows 5.0 / 6.4 ms
# against XLA's reduction form's 9.6 / 9.8; more rows: the GEMM).
MAX_ROWS = 16
_reason: Optional[str] = None


def cpu_flags() -> set:
  """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def _compiler() -> Optional[str]:
  return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _build() -> Path:
  """Compile the sources (once per source, flags, compiler and jaxlib) -> the .so."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX)")
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                           check=False).stdout.splitlines()[:1]
  key = hashlib.sha256("\n".join([*(f.read_text() for f in _SOURCES + _HEADERS), " ".join(_FLAGS),
                                  *version,
                                  jaxlib.__version__]).encode()).hexdigest()[:16]
  cache = Path(os.environ.get("SPECJAX_KERNEL_CACHE",
                              Path.home() / ".cache" / "specjax" / "kernels"))
  lib = cache / f"kernels-{key}.so"
  if lib.exists():
    return lib
  cache.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
  os.close(fd)
  cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", tmp]
  res = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if res.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
  os.replace(tmp, lib)  # atomic: concurrent builders each write their own file
  return lib


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether `rowdot` runs here (built and registered with XLA on first call)."""
  global _reason
  if os.environ.get("SPECJAX_ROWDOT", "1") == "0":
    _reason = "SPECJAX_ROWDOT=0"
    return False
  if platform.machine().lower() not in ("x86_64", "amd64"):
    _reason = f"an x86-64 kernel; this machine is {platform.machine()}"
    return False
  missing = {"avx2", "fma"} - cpu_flags()
  if missing:
    _reason = f"the CPU lacks {', '.join(sorted(missing))}"
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    for target, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (RuntimeError, OSError) as e:
    _reason = f"could not build the kernel: {e}"
    warnings.warn(f"specjax: the rowdot CPU kernel is unavailable ({_reason}); "
                  "decoding keeps XLA's products", RuntimeWarning)
    return False
  return True


def unavailable_reason() -> Optional[str]:
  """Why `available()` is False (None when it is True or was not asked)."""
  return _reason


def _call(x, w, valid):
  if not available():
    raise RuntimeError(f"the rowdot kernel is unavailable here: {unavailable_reason()}")
  valid = jnp.reshape(x.shape[0] if valid is None else valid, (1,)).astype(jnp.int32)
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
  return jax.ffi.ffi_call("specjax_rowdot", out, vmap_method="sequential")(x, w, valid)


@jax.custom_vjp
def rowdot(x: jax.Array, w: jax.Array, valid: Optional[jax.Array] = None) -> jax.Array:
  """x (R, D) float32 @ w^T for w (F, D) float32 or bfloat16 -> (R, F) float32
  (8 rows per pass over w); on the CPU, where `available()`. A row's result
  does not depend on R or on the other rows. `valid` (a traced int32 scalar):
  only rows [0, valid) are computed, the others come back zero (a padded
  tile's real rows cost what they would alone)."""
  return _call(x, w, valid)


def _fwd(x, w, valid):
  return _call(x, w, valid), (x, w, valid)


def _bwd(res, g):  # the plain product's gradients (training never needs the kernel's bits)
  x, w, valid = res
  if valid is not None:
    g = jnp.where(jnp.arange(g.shape[0])[:, None] < valid, g, 0.0)
  gx = jnp.einsum("rf,fd->rd", g, w.astype(jnp.float32))
  gw = jnp.einsum("rf,rd->fd", g, x).astype(w.dtype)
  return gx, gw, None


rowdot.defvjp(_fwd, _bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, row: jax.Array, src: jax.Array,
              visible: jax.Array, valid: jax.Array, scale: float) -> jax.Array:
  """Decode attention of P query rows, each over its own view of the cache
  (source in `attention.cc`): q (P, H, Dh) float32; k, v (B, S, G, Dh) the
  cache (float32 or bfloat16; H a multiple of G); row (P,) each query's batch
  row; src (P, S) the cache slot each view slot reads; visible (P, S) which
  view slots it attends to; rows [0, valid) computed, the others zero.
  -> (P, H, Dh) float32: softmax(scale q.K) V over the visible view slots in
  view order, the weights rounded to the cache's dtype. A row's result does
  not depend on the other rows, P, S or the invisible slots. No gradient."""
  if not available():
    raise RuntimeError(f"the attention kernel is unavailable here: {unavailable_reason()}")
  return jax.ffi.ffi_call("specjax_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")(
      q.astype(jnp.float32), k, v, row.astype(jnp.int32), src.astype(jnp.int32),
      visible.astype(jnp.bool_), jnp.reshape(valid, (1,)).astype(jnp.int32),
      scale=np.float32(scale))
