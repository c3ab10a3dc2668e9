"""Benchmark providers: one module per op family; each registers with ``benchmarks.registry.register``."""
