"""Collective benchmarks with nccl-tests' output and formulas, and the pre-flight health check."""
