"""What the rank drill-down screen shows, from the run view: one rank's history over the live window. Pure, no Textual.

Per series (step time, compute, exposed comm, data wait, sync wait, pipeline wait when there is any), the rank's
values step by step and, beside them, the median over its peers at the same steps: a straggler reads as its
compute above the peers', a victim as its sync wait above theirs. Then its findings (those naming it, or naming its
node without naming ranks) and its GPU samples (the GPUs whose samples name it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ranksight import schema
from tui.client import GpuState
from tui.model import RankRow, RunView

# (label, StepRecord field): "wait" is split in two because they mean different things: the sync wait is the time
# this rank waited in the gradient sync for the slowest peer, the pipeline wait its time blocked on p2p (bubble).
SERIES = (("step time", "step_ms"), ("compute", "compute_ms"), ("comm (exposed)", "comm_ms"),
          ("data wait", "data_ms"), ("sync wait", "sync_wait_ms"), ("pipeline wait", "pipeline_wait_ms"))
OPTIONAL = {"pipeline_wait_ms"}  # shown only when some step has it


@dataclass
class Series:
    label: str
    key: str
    values: list[float]  # the rank's, one per step it reported a finite value
    peers: float | None  # the median over the other ranks' values at the same steps
    missing: int = 0  # steps with no value (not measured)

    @property
    def last(self) -> float | None:
        return self.values[-1] if self.values else None


@dataclass
class RankDetail:
    rank: int
    row: RankRow | None
    steps: list[int]
    series: list[Series] = field(default_factory=list)
    findings: list[schema.Finding] = field(default_factory=list)
    gpus: list[GpuState] = field(default_factory=list)


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def rank_detail(v: RunView, rank: int) -> RankDetail:
    row = next((r for r in v.rows if r.rank == rank), None)
    recs = v.history.get(rank, [])
    steps = [s.step for s in recs]
    in_window = set(steps)
    series = []
    for label, key in SERIES:
        vals = [getattr(s, key) for s in recs]
        mine = [float(x) for x in vals if _finite(x)]
        if key in OPTIONAL and not any(mine):
            continue
        peers = [getattr(s, key) for r, rs in v.history.items() if r != rank for s in rs if s.step in in_window]
        peers = [float(x) for x in peers if _finite(x)]
        series.append(Series(label, key, mine, statistics.median(peers) if peers else None, len(vals) - len(mine)))
    node = row.node if row else None
    findings = [f for f in v.findings if rank in f.ranks or (not f.ranks and node is not None and node in f.nodes)]
    gpus = [g for g in (v.gpus or []) if rank in g.ranks]
    return RankDetail(rank=rank, row=row, steps=steps, series=series, findings=findings, gpus=gpus)


def neighbour(v: RunView, rank: int, step: int) -> int:
    """The rank ``step`` places away from ``rank`` among the job's ranks (wrapping)."""
    ranks = [r.rank for r in v.rows]
    if rank not in ranks:
        return ranks[0] if ranks else rank
    return ranks[(ranks.index(rank) + step) % len(ranks)]
