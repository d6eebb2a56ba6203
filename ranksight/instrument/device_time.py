"""Time on the device: CUDA events recorded on the training stream, read back a step or more later.

NCCL work is asynchronous: when a comm hook runs, the host has only *queued* the gradient all-reduce, and a host
clock around it measures the enqueue. What matters happens on the device: when the compute stream reaches the point
where a gradient bucket is ready (this rank's arrival), when the collective completes there, and how long the
stream was busy. So every timing point of a step is also a CUDA event recorded on the current stream, and the step
is resolved once its events have run (``StepMarks.done()``, polled at later step boundaries: no device sync, no stall
of the training stream).

Events measure intervals; ``DeviceClock`` puts them on the wall clock shared by every rank, so arrivals compare
across ranks: it records an *anchor* event on an idle side stream and waits for that event alone (the training
stream keeps running), taking the wall time when it has run. An event's wall time is then the anchor's plus the
elapsed time between them. The anchor is renewed every ``RESYNC_S`` so the two clocks cannot drift apart.

On a CPU there is no device: ``ranksight.instrument.session`` uses the training thread's CPU time instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

RESYNC_S = 30.0


@dataclass(slots=True)
class Anchor:
    event: object  # torch.cuda.Event (timing), already run
    wall: float  # time.time() when it had run


class DeviceClock:
    """CUDA events on the current stream, and their wall times through an anchor."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        self.anchor = self._new_anchor()
        self._anchor_mono = time.monotonic()

    def _new_anchor(self) -> Anchor:
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record(self.side)  # nothing else runs on the side stream: the event runs at once
        ev.synchronize()  # waits for this event only: the training stream is not touched
        return Anchor(ev, time.time())

    def current_anchor(self) -> Anchor:
        """The anchor for a step starting now (renewed every RESYNC_S)."""
        now = time.monotonic()
        if now - self._anchor_mono > RESYNC_S:
            self.anchor = self._new_anchor()
            self._anchor_mono = now
        return self.anchor

    def mark(self):
        """An event on the current stream: it runs when the work queued before it has run."""
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev


def wall(anchor: Anchor, ev) -> float:
    """The wall time ``ev`` ran at (both have run)."""
    return anchor.wall + anchor.event.elapsed_time(ev) / 1000.0


def has_run(ev) -> bool:
    return ev is None or ev.query()


@dataclass(slots=True)
class StepMarks:
    """The device events of one step, beyond those its collectives carry."""

    anchor: Anchor
    start: object  # event at step start
    end: object | None = None  # event at step end
    data: list[tuple[object, object]] = field(default_factory=list)  # spans of the data phase (input copies)
    pipeline_wait: list[tuple[object, object]] = field(default_factory=list)  # spans blocked in pipeline p2p

    def events(self):
        yield self.start
        yield self.end
        for a, b in self.data:
            yield a
            yield b
        for a, b in self.pipeline_wait:
            yield a
            yield b

    def span_s(self, spans: list[tuple[object, object]]) -> float:
        return sum(max(0.0, a.elapsed_time(b) / 1000.0) for a, b in spans)
