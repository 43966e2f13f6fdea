"""Benchmarks: memory in bytes, time as a ratio against a baseline measured in the same run."""
