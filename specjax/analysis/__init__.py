"""Theory, distribution distances and statistical tests for speculative decoding."""
