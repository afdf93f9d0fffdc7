"""Benchmarks and GPU checks of storm-compile."""
