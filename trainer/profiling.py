"""PyTorch profiler windows: on a schedule (trace N steps every K, off by default) and on demand.

One Kineto trace per rank per window: ``<run>/traces/rank-<R>.<tag>.json``, where tag is
``step<first>-<last>`` (scheduled) or ``ondemand-step<first>-<last>`` (control request).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from ranksight.layout import RunDir


class Profiler:
    def __init__(self, run: RunDir, rank: int, every: int, steps: int, warmup: int, device, recorder):
        self.run, self.rank = run, rank
        self.every, self.steps, self.warmup = every, steps, warmup
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.recorder = recorder
        self.prof = None
        self.window: tuple[int, int] | None = None  # active (first, last) step
        self.tag_prefix = ""
        self.pending_demand: tuple[int, str] | None = None

    def request(self, steps: int, tag: str) -> None:
        """On demand: trace the next ``steps`` steps (starts at the next step boundary)."""
        self.pending_demand = (steps, tag)

    def before_step(self, step: int) -> bool:
        """Start a window if one is due. Returns whether this step is traced."""
        if self.prof is None:
            if self.pending_demand is not None:
                n, tag = self.pending_demand
                self.pending_demand = None
                self._start(step, 0, n, f"{tag}-")
            elif self.every and step % self.every == 0 and step > 0:
                self._start(step, self.warmup, self.steps, "")
        return self.window is not None and self.window[0] <= step <= self.window[1]

    def _start(self, step: int, warmup: int, n: int, prefix: str) -> None:
        self.window = (step + warmup, step + warmup + n - 1)
        self.tag_prefix = prefix
        self.prof = profile(activities=self.activities, schedule=torch.profiler.schedule(
            wait=0, warmup=warmup, active=n, repeat=1), on_trace_ready=self._export)
        self.prof.start()
        self.recorder.event("profile_start", {"first_step": self.window[0], "last_step": self.window[1]}, step=step)

    def _export(self, prof) -> None:
        first, last = self.window
        path = self.run.traces_dir / f"rank-{self.rank}.{self.tag_prefix}step{first}-{last}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.recorder.event("profile_stop", {"trace": str(path), "first_step": first, "last_step": last})

    def after_step(self, step: int) -> None:
        if self.prof is None:
            return
        self.prof.step()
        if step >= self.window[1]:
            self.prof.stop()
            self.prof = None
            self.window = None

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
