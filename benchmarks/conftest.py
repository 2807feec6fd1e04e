"""Benchmark configuration."""
