"""How hard XLA works on the suite's programs (imported by conftest.py and by
the tests that start JAX worker processes).

Most modules build many programs (a drafter, a shape, a sampling setting
each) and run each for a moment on a tiny model: there optimisation costs more
than it saves. They compile with JAX's `jax_disable_most_optimizations` (LLVM
-O0, no expensive passes) and with XLA CPU's legacy fusion emitters
(`xla_cpu_use_fusion_emitters=false`): at -O0 the newer MLIR emitters take
twice as long (the tiny golden runs: 348 -> 128 s of XLA compile for the same
186 programs), while at full optimisation they are the faster ones (SmolLM2's
decode program: 4.8 s against 22 s). Outputs do not change: the golden tokens
are reproduced either way. Modules whose time is execution (10^5-request
Monte-Carlo runs, the real 30-layer model) keep XLA's defaults.

The settings are read at each compile and are part of the persistent cache's
key, so programs of the two kinds never mix. Worker processes of tiny-model
tests (8 forced devices, two-process jobs, resumed runs) are compile-bound
too: `unoptimized_env` gives them the same settings.
"""

from __future__ import annotations

import jax

OPTIMIZED_MODULES = {
    "test_exactness_montecarlo.py",  # 10^5-request batches
    # the whole SmolLM2 (measured on eagle3, B = 5, 32 tokens: -O0 saved 15% of
    # the compile and made the run 60% slower)
    "test_golden.py", "test_smollm2_speculative.py", "test_smollm2.py",
    "test_generate_experiment.py", "test_distill_data.py", "test_ar_benchmark.py",
    # bitwise batch invariance is a property of the optimised kernels CI and users run
    "test_batch_invariant.py",
}

# XLA debug options added to every compile made while
# `jax_disable_most_optimizations` is on.
UNOPTIMIZED_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def unoptimized_env(env: dict) -> dict:
  """`env` for a JAX child process that runs only tiny, compile-bound programs."""
  env = dict(env)
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  flags = env.get("XLA_FLAGS", "").split()
  for name, value in UNOPTIMIZED_OPTIONS.items():
    flags = [f for f in flags if not f.startswith(f"--{name}=")]
    flags.append(f"--{name}={str(value).lower()}")
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def install() -> None:
  """Add UNOPTIMIZED_OPTIONS to the options of every compile made while
  `jax_disable_most_optimizations` is on (JAX builds each compile's options in
  `jax._src.compiler.get_compile_options`; explicit per-jit options win)."""
  from jax._src import compiler  # pylint: disable=import-outside-toplevel
  original = compiler.get_compile_options
  if getattr(original, "_specjax_unoptimized", False):
    return

  def get_compile_options(*args, env_options_overrides=None, **kwargs):
    if jax.config.read("jax_disable_most_optimizations"):
      env_options_overrides = {**UNOPTIMIZED_OPTIONS, **(env_options_overrides or {})}
    return original(*args, env_options_overrides=env_options_overrides, **kwargs)

  get_compile_options._specjax_unoptimized = True  # pylint: disable=protected-access
  compiler.get_compile_options = get_compile_options
