"""ranksight: observability and diagnostics for distributed PyTorch training."""

__version__ = "0.1.0"
