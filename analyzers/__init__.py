"""Detectors over a run's data, the findings they produce, and the diagnose report."""
