"""Loader and model throughput benchmarks per hardware (filled in by a later issue)."""
