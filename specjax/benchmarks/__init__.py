"""Benchmarks behind the experiment mains: they return dicts of figures and
never assert on time (timed assertions belong nowhere in the tests)."""
