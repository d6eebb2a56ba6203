"""What the traces screen shows, from the rows of ``GET /api/runs/<id>/traces``. Pure functions, no Textual.

The screen shows the newest capture window: per rank, the kernel time per step (host op time on a CPU trace),
the NCCL kernel time per step, the communication not hidden under compute, the share of the window the device
was idle, and the kernel time as a ratio to the window's median over ranks. The rank with the highest ratio is
"the slowest"; the screen marks it, and does not call it a straggler (the head's analyzers decide that and say so
in the findings). When the job has more ranks than the screen has rows, the rows become nodes, each with its
slowest rank named and that rank's figures shown.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from tui.client import TraceRow

CPU_NOTE = "CPU trace: op time is host time, not device kernel time"
EMPTY_NOTE = "no profiler trace captured yet — press a to request a profile"


@dataclass(frozen=True)
class TraceLine:
    """One row of the table: a rank, or a node (then ``rank`` is its slowest rank and the figures are that rank's)."""

    rank: int
    node: int | None
    kernel: float | None  # ms per step, or per window when the capture has no step count
    nccl: float | None
    exposed: float | None
    idle_share: float | None
    ratio: float | None  # kernel / the window's median kernel over ranks
    slowest: bool = False
    truncated: bool = False
    ranks: int = 1  # ranks of the node (node rows)


@dataclass
class TraceView:
    step_start: int = -1
    step_end: int = -1
    steps: int | None = None
    kind: str = "periodic"
    devices: tuple[str, ...] = ()
    ranks: list[TraceLine] = field(default_factory=list)
    median_kernel: float | None = None
    slowest: TraceLine | None = None
    truncated: int = 0
    world: int | None = None  # the job's ranks, when known (the newest window may not have all of them yet)
    trace_files: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ranks

    @property
    def cpu(self) -> bool:
        return "cpu" in self.devices

    @property
    def per_step(self) -> bool:
        return bool(self.steps)

    def nodes(self) -> list[TraceLine]:
        """One line per node: its slowest rank's figures, the rank named; nodes in order, unknown node last."""
        by_node: dict[int | None, list[TraceLine]] = {}
        for r in self.ranks:
            by_node.setdefault(r.node, []).append(r)
        out = []
        for node in sorted(by_node, key=lambda n: (n is None, n if n is not None else 0)):
            rs = by_node[node]
            worst = max(rs, key=lambda r: (-math.inf if r.kernel is None else r.kernel, -r.rank))
            out.append(TraceLine(rank=worst.rank, node=node, kernel=worst.kernel, nccl=worst.nccl,
                                 exposed=worst.exposed, idle_share=worst.idle_share, ratio=worst.ratio,
                                 slowest=any(r.slowest for r in rs), truncated=any(r.truncated for r in rs),
                                 ranks=len(rs)))
        return out


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def newest_window(rows: list[TraceRow]) -> list[TraceRow]:
    """The rows of the newest capture window (the API lists windows oldest first)."""
    if not rows:
        return []
    w = rows[-1].window
    return [r for r in rows if r.window == w]


def build_trace_view(rows: list[TraceRow], world: int | None = None) -> TraceView:
    win = newest_window(rows)
    if not win:
        return TraceView(world=world)
    first = win[0]
    steps = first.steps
    per_step = bool(steps)
    lines = []
    for r in sorted(win, key=lambda r: r.rank):
        if per_step:
            k, n, e = r.kernel_ms_per_step, r.nccl_ms_per_step, r.exposed_comm_ms_per_step
        else:  # no ProfilerStep annotations: the window's totals, and the screen says so
            k, n, e = r.kernel_ms, r.nccl_ms, r.exposed_comm_ms
        lines.append((r, _finite(k), _finite(n), _finite(e)))
    kernels = [k for _, k, _, _ in lines if k is not None]
    med = statistics.median(kernels) if kernels else None
    out = [TraceLine(rank=r.rank, node=r.node, kernel=k, nccl=n, exposed=e, idle_share=_finite(r.idle_share),
                     ratio=(k / med if k is not None and med else None), truncated=r.truncated)
           for r, k, n, e in lines]
    slowest = None
    if len(kernels) >= 2:  # one rank has no one to be slower than
        i = max(range(len(out)), key=lambda j: (-math.inf if out[j].ratio is None else out[j].ratio, -out[j].rank))
        out[i] = TraceLine(**{**out[i].__dict__, "slowest": True})
        slowest = out[i]
    return TraceView(step_start=first.step_start, step_end=first.step_end, steps=steps, kind=first.kind,
                     devices=tuple(sorted({r.device for r in win})), ranks=out, median_kernel=med, slowest=slowest,
                     truncated=sum(1 for r in win if r.truncated), world=world,
                     trace_files=tuple(r.trace_file for r in win))


def fmt_num(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def fmt_ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def fmt_share(v: float | None) -> str:
    return "—" if v is None else f"{v:.0%}"
