"""Benchmarks (not tests): `python -m benchmarks.run [--quick]` runs them all; results go to RESULTS.md."""
