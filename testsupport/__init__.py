"""What the tests and the benchmarks share: test support, never shipped with the service."""
