"""Testing tools the library ships: the file fuzzer (specjax.testing.fuzz)."""
