"""A straggler made on purpose, shared by the examples: ``--slow-rank R --slow-factor F --slow-start S``.

From step S on, rank R does real extra work in every step, (F - 1) times the compute it just did (the forward pass
it measured, times 3 for forward + backward), placed after its forward and before its backward, so it reaches the
gradient sync late, as a slow GPU would: on a CPU, matmuls on its training thread (its CPU time grows because it *is*
slower); on CUDA, matmul kernels on the current stream (the forward is timed with CUDA events, and this rank's host
waits for them: the demo's own cost, on the slow rank only). This is the examples' own code, not ranksight's:
ranksight is told nothing about it and finds the slow rank from what it measures.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

# forward + backward ~ 3 x forward (backward computes the gradients of both the inputs and the weights)
FORWARD_TO_STEP = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slow-rank", type=int, default=None, help="make this rank slow on purpose (a straggler)")
    parser.add_argument("--slow-factor", type=float, default=1.5, help="its compute takes this many times longer")
    parser.add_argument("--slow-start", type=int, default=5, help="from this step on")


class Straggler:
    """Extra work on one rank (a no-op on the others and before ``start``)."""

    def __init__(self, rank: int, slow_rank: int | None, factor: float, start: int, device: str = "cpu"):
        if factor < 1.0:
            raise ValueError(f"--slow-factor is a slow-down, >= 1 (got {factor})")
        self.active = slow_rank is not None and rank == slow_rank and factor > 1.0
        self.factor, self.start, self.device = factor, start, device
        self._a = self._b = None
        self._kernel_s = 0.0

    @classmethod
    def from_args(cls, rank: int, args: argparse.Namespace, device: str = "cpu") -> Straggler:
        return cls(rank, args.slow_rank, args.slow_factor, args.slow_start, device)

    @contextlib.contextmanager
    def forward(self, step: int):
        """Around this rank's forward pass: afterwards, the extra work of the whole step, before backward."""
        if not (self.active and step >= self.start):
            yield
            return
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            self.burn_cuda((self.factor - 1.0) * FORWARD_TO_STEP * start.elapsed_time(end) / 1000.0)
            return
        t0 = time.thread_time()
        yield
        self.burn((self.factor - 1.0) * FORWARD_TO_STEP * (time.thread_time() - t0))

    def burn_cuda(self, seconds: float) -> None:
        """As many 2048x2048 matmul kernels on the current stream as take ``seconds`` (timed once)."""
        if self._a is None:
            self._a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
            self._b = torch.empty_like(self._a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                torch.mm(self._a, self._a, out=self._b)
            end.record()
            end.synchronize()
            self._kernel_s = start.elapsed_time(end) / 1000.0 / 20
        for _ in range(max(1, round(seconds / max(self._kernel_s, 1e-6)))):
            torch.mm(self._a, self._a, out=self._b)

    def burn(self, seconds: float) -> None:
        """Matmuls on this thread until its CPU time has grown by ``seconds`` (CPU time, not wall time: a busy
        machine that schedules the rank late does not shorten the work)."""
        if self._a is None:
            self._a = torch.randn(96, 96)
            self._b = torch.empty_like(self._a)
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            torch.mm(self._a, self._a, out=self._b)
