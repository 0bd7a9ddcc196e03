"""Benchmarks, each runnable as ``python bench/<name>.py`` from the repository root."""
