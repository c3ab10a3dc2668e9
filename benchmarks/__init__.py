"""Benchmarks: one entry point (``python -m benchmarks.run``) over a registry of providers per op."""
