"""Deterministic datasets addressed by *global sample index*.

A sample is a function of (seed, global index) only, never of the rank or the
world size. The data position saved in a checkpoint is the number of global
samples consumed, so a resumed run (same or different dp degree) continues with
exactly the samples an uninterrupted run would have seen, and a single-process
reference run sees the same global batches as a dp run.

Layout of one optimizer step: ``grad_accum`` micro-steps; micro-step k covers
global samples ``pos + k*B*dp ... pos + (k+1)*B*dp - 1`` and dp rank r takes the
r-th block of ``B`` of them.
"""

from __future__ import annotations

from pathlib import Path

import torch


class SyntheticTokens:
    """Arithmetic token sequences: x[t] = (start + stride·t) mod m, start and stride drawn per sample,
    m = min(vocab, 64).

    Learnable at two speeds, so the loss falls visibly within a few steps even for a tiny
    model (only the first m ids occur: ln(vocab) -> ln(m) quickly), and further as the model
    infers the stride from the context. Exactly reproducible from (seed, index).
    """

    name = "synthetic"

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.modulus = min(vocab, 64)
        self._t = torch.arange(seq_len + 1)

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.modulus, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        return (start + stride * self._t) % self.modulus


class TextFileTokens:
    """Byte-level tokens (vocab 256) from windows of a text file, window start drawn from (seed, index)."""

    def __init__(self, path: str, vocab: int, seq_len: int, seed: int):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--dataset textfile:{path}: no such file")
        data = p.read_bytes()
        if len(data) < seq_len + 2:
            raise ValueError(f"--dataset textfile:{path}: {len(data)} bytes, need at least seq_len+2 = {seq_len + 2}")
        if vocab < 256:
            raise ValueError(f"textfile datasets are byte-level: --vocab must be >= 256, got {vocab}")
        self.name = f"textfile:{path}"
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len, self.seed = seq_len, seed

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, len(self.data) - self.seq_len - 1, (1,), generator=gen))
        return self.data[start : start + self.seq_len + 1]


def make_dataset(spec: str, vocab: int, seq_len: int, seed: int):
    if spec == "synthetic":
        return SyntheticTokens(vocab, seq_len, seed)
    if spec.startswith("textfile:"):
        return TextFileTokens(spec.split(":", 1)[1], vocab, seq_len, seed)
    raise ValueError(f"unknown dataset {spec!r}: use 'synthetic' or 'textfile:PATH'")


class DataLoader:
    """Hands this dp rank its micro-batches; ``position`` (global samples consumed) is checkpointed."""

    def __init__(self, dataset, batch_size: int, dp: int, dp_rank: int, position: int = 0):
        self.dataset, self.batch_size, self.dp, self.dp_rank = dataset, batch_size, dp, dp_rank
        self.position = position

    def micro_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.position + k * self.batch_size * self.dp + self.dp_rank * self.batch_size
        rows = torch.stack([self.dataset.sample(first + i) for i in range(self.batch_size)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def advance(self, micro_steps: int) -> None:
        self.position += micro_steps * self.batch_size * self.dp
