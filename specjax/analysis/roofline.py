"""Memory roofline of decoding: a decode step reads every weight once.

At small batch a decode step is bound by memory bandwidth, not arithmetic: the
whole parameter pytree streams from memory for one token per row. So
`weight bytes / read bandwidth` is a floor on the time of one step, whatever the
batch size, and `measured / floor` says how far an implementation is from the
hardware (KV cache reads add to the floor; they are reported separately).

The bandwidth is measured the way a decode step reads: a jitted XLA reduction
over a large float32 array already on the device, on all cores (XLA's CPU
backend uses them by default).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
  """Read bandwidth of a jitted sum over `num_bytes` of float32 on the default device.

  Returns a dict: bytes, repeats, times_s (each timed run; the compile run is
  excluded), best_gbps, median_gbps (decimal GB/s, 1e9 bytes), device.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  n = int(num_bytes) // 4
  if n < 1:
    raise ValueError(f"num_bytes must be >= 4, got {num_bytes}")
  # Made on device by a jitted fill: a host array would measure the transfer.
  x = jax.jit(lambda: jnp.ones((n,), jnp.float32))()
  x.block_until_ready()
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    total(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  nbytes = n * 4
  del x
  return {
      "bytes": nbytes,
      "repeats": repeats,
      "times_s": times,
      "best_gbps": nbytes / min(times) / 1e9,
      "median_gbps": nbytes / statistics.median(times) / 1e9,
      "device": str(jax.devices()[0]),
  }


def weight_bytes(params) -> int:
  """Bytes of every array in a params pytree (what one decode step reads)."""
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                 for x in jax.tree.leaves(params)))


def roofline_ms_per_token(weight_bytes: float, bandwidth_gbps: float) -> float:
  """Lower bound on one decode step, in ms: bytes read / bandwidth (GB/s, 1e9 bytes).

  One step emits one token per row, so this is also the per-row ms/token floor
  at any batch size small enough to stay memory-bound.
  """
  if bandwidth_gbps <= 0:
    raise ValueError(f"bandwidth must be positive, got {bandwidth_gbps}")
  return 1e3 * float(weight_bytes) / (float(bandwidth_gbps) * 1e9)
