"""Benchmark harness: named model shapes, hardware ceilings, end-to-end and kernel benchmarks."""
