"""Benchmarks (each runnable as ``python bench/<name>.py`` from the repository root) and the
load driver of the load and soak tests (``bench.load_sim``)."""
