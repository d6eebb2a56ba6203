"""Callbacks that instrument a training framework's loop with ``ranksight.init`` (docs/instrument.md).

- ``lightning.RanksightCallback``: a Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``).
- ``hf.RanksightCallback``: a Hugging Face ``transformers.TrainerCallback``.
- ``batch``: what the callbacks count in a batch (tokens).

Neither module imports its framework (nor torch) until ``RanksightCallback`` is used: the class is made then, on the
framework's own base class.
"""
