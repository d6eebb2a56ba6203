"""ranksight: observability and diagnostics for distributed PyTorch training.

A training loop is instrumented with ``ranksight.init`` (``ranksight.instrument``): imported lazily, so the node
agent and the head, which use only the shared formats in this package, never import torch.
"""

__version__ = "0.1.0"


def init(*args, **kwargs):
    """Instrument this rank of a training job: see ``ranksight.instrument.init``."""
    from ranksight.instrument import init as _init

    return _init(*args, **kwargs)
