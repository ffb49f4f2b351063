"""specjax: speculative decoding in JAX, exact by construction and by test."""

import os as _os

# XLA hoists loop-invariant work out of while loops, including the bf16 ->
# f32 conversion of every weight matrix that feeds a CPU product: a bf16
# model inside a decode loop then reads materialised f32 copies (2x the
# memory, none of bf16's bandwidth saving; measured on the 2-core dev CPU:
# 1-token bf16 step 96 ms with the pass, 45 ms without; f32 unchanged).
# XLA reads XLA_FLAGS once, when the first backend starts, so this only takes
# effect if specjax is imported before JAX runs anything. Set
# SPECJAX_KEEP_XLA_FLAGS=1 to leave XLA_FLAGS untouched.
_FLAG = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"
if not _os.environ.get("SPECJAX_KEEP_XLA_FLAGS"):
  _flags = _os.environ.get("XLA_FLAGS", "")
  if "xla_disable_hlo_passes" not in _flags:
    _os.environ["XLA_FLAGS"] = (_flags + " " + _FLAG).strip()


def use_compilation_cache(min_compile_time_s: float = 1.0) -> str:
  """Keep compiled XLA programs on disk across processes (experiments, test
  workers, resumed runs): $SPECJAX_JAX_CACHE or ~/.cache/specjax/xla. Results
  never depend on it; only compile time does. -> the cache directory."""
  import jax  # pylint: disable=import-outside-toplevel
  path = _os.environ.get("SPECJAX_JAX_CACHE",
                         _os.path.join(_os.path.expanduser("~"), ".cache", "specjax", "xla"))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
  return path
