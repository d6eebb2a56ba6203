"""This rank's memory peak per step, for ``StepRecord.mem_bytes``."""

from __future__ import annotations

import os


class MemoryProbe:
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.statm_fd = None
        if not self.cuda:
            try:
                # RSS = statm's second field x page size (what psutil's memory_info().rss reads), from a
                # descriptor kept open: one pread per step instead of psutil's open/read/close and parsing.
                self.statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
                self.page = os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, AttributeError):
                import psutil

                self.proc = psutil.Process()

    def sample(self) -> int:
        """Peak this step: CUDA max allocated (then reset), or the process RSS on CPU."""
        if self.cuda:
            import torch

            v = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return int(v)
        if self.statm_fd is not None:
            return int(os.pread(self.statm_fd, 128, 0).split()[1]) * self.page
        return int(self.proc.memory_info().rss)
