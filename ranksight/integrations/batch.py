"""Tokens in a batch, counted the way ``ranksight.init`` counts a model's input when the loop does not say."""

from __future__ import annotations

from collections.abc import Mapping

# the keys a batch's token ids go by (Hugging Face models and most language-model data pipelines)
TOKEN_KEYS = ("input_ids", "tokens", "input")


def first_tensor(batch):
    """The tensor a batch leads with: the batch itself, its ``input_ids`` (or the first tensor) in a mapping, its
    first tensor in a tuple or list; None if it holds none."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        for key in TOKEN_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    else:
        return None
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def count_tokens(batch) -> int:
    """Token ids (an integer tensor): every element is a token. Features (a float tensor): one sample per row."""
    t = first_tensor(batch)
    if t is None:
        return 0
    if t.is_floating_point():
        return int(t.shape[0]) if t.dim() else 1
    return int(t.numel())
