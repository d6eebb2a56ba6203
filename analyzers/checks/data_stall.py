"""Data stalls: time waiting for the next batch as a share of step time, per rank, persistent.

A rank whose ``data_ms`` share is above ``share`` (and at least ``min_ms``) in ``persist`` of
``window`` steps is stalled; when every rank is, the input pipeline is slow everywhere (one
world finding). A single stalled rank arrives late at the gradient sync, so its peers wait: its
victims' wait is reported, and the straggler check does not blame it (compute excludes data).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyzers.builder import AnalysisFrame, Coverage, StepView
from analyzers.evidence import fnum
from analyzers.persistence import confirmation_step, persistent_runs, rows_with_runs
from ranksight.schema import Finding

NAME = "data_stall"


@dataclass
class DataStallConfig:
    share: float = 0.10  # data wait / step time
    min_ms: float = 5.0
    critical_share: float = 0.5
    persist: int = 3
    window: int = 5
    warmup_steps: int = 1  # the first batch includes worker start-up


def coverage(frame: AnalysisFrame, cfg: DataStallConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs the time each step waited for its batch (``data_ms``)."""
    if not frame.signals.data_wait:
        return Coverage(NAME, "not_run",
                        "no data_ms in the step records: time fetching the batch with rs.phase('data')")
    return Coverage(NAME, "ran")


def _may_stall(judged: StepView, cfg: DataStallConfig) -> bool:
    """Whether some rank has ``persist`` stalled step rows (the matrices' flags, by row: a view holds at most one row a
    rank and step, and a cell without a row is not flagged), so that a run with none is judged without building the
    three rank x step matrices. Compared in float64, as the matrices hold the values."""
    share = judged.column("data_share").to_numpy(dtype=np.float64)
    ms = judged.column("data_ms").to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore"):
        flagged = (share >= cfg.share) & (ms >= cfg.min_ms)
    if not flagged.any():
        return False
    _, counts = np.unique(judged.rows["rank"].to_numpy()[flagged], return_counts=True)
    return bool((counts >= max(cfg.persist, 1)).any())


def analyze(frame: AnalysisFrame, cfg: DataStallConfig | None = None) -> list[Finding]:
    cfg = cfg or DataStallConfig()
    if frame.data.steps.empty:
        return []
    judged = frame.judged(cfg.warmup_steps)
    if judged.rows.empty or not _may_stall(judged, cfg):
        return []
    share = judged.matrix("data_share")
    ms = judged.matrix("data_ms")
    wait = judged.matrix("sync_wait_ms")
    cands = []
    flag_rows = ((share >= cfg.share) & (ms >= cfg.min_ms)).fillna(False)
    for r in rows_with_runs(flag_rows, cfg.persist):
        flags = flag_rows.loc[r]
        for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
            others = [x for x in share.index if x != r]
            cands.append(dict(rank=int(r), onset=s0, end=s1, n=n, share=float(share.loc[r, s0:s1].median()),
                              ms=float(ms.loc[r, s0:s1].median()),
                              peers_ms=float(np.nanmedian(ms.loc[others, s0:s1].to_numpy(dtype=float))) if others else None,
                              victims_wait=float(np.nanmean(wait.loc[others, s0:s1].to_numpy(dtype=float))) if others and wait.notna().values.any() else None,
                              confirmed=confirmation_step(flags, s0, cfg.persist)))
    if not cands:
        return []
    node_of = frame.placement.rank_node
    all_ranks = set(int(r) for r in share.index)
    flagged = {c["rank"] for c in cands}
    if flagged == all_ranks and len(all_ranks) > 1:
        s0 = min(c["onset"] for c in cands)
        med = float(np.median([c["share"] for c in cands]))
        return [Finding(
            analyzer=NAME, kind="data_stall", severity="critical" if med >= cfg.critical_share else "warning",
            ranks=sorted(all_ranks), nodes=frame.placement.nodes_of(all_ranks), step_start=s0, step_end=max(c["end"] for c in cands),
            evidence=dict(scope="world", data_share=fnum(med, 3), data_ms_median=fnum(np.median([c["ms"] for c in cands]), 1),
                          onset_step=s0, detected_at_step=max(c["confirmed"] for c in cands), steps_affected=max(c["n"] for c in cands)),
            confidence=0.85,
            summary=f"every rank waits for data: {med:.0%} of step time since step {s0}",
            recommendation="Speed up the input pipeline: more DataLoader workers, prefetch_factor, pinned memory, local or faster storage.",
        )]
    out = []
    for c in cands:
        node = node_of.get(c["rank"])
        wait_txt = f"; peers wait {c['victims_wait']:.0f} ms per step for it" if c["victims_wait"] is not None else ""
        out.append(Finding(
            analyzer=NAME, kind="data_stall", severity="critical" if c["share"] >= cfg.critical_share else "warning",
            ranks=[c["rank"]], nodes=[node] if node is not None else [], step_start=c["onset"], step_end=c["end"],
            evidence=dict(scope="rank", data_share=fnum(c["share"], 3), data_ms_median=fnum(c["ms"], 1),
                          peers_data_ms_median=fnum(c["peers_ms"], 1), victims_mean_wait_ms=fnum(c["victims_wait"], 1),
                          onset_step=c["onset"], detected_at_step=c["confirmed"], steps_affected=c["n"]),
            confidence=0.85,
            summary=(f"rank {c['rank']} (node {node}) waits {c['ms']:.0f} ms per step for data ({c['share']:.0%} of step time) "
                     f"since step {c['onset']}{wait_txt}"),
            recommendation=f"Check the data loader of rank {c['rank']} on node {node}: its storage/network path, worker count, and CPU load there.",
        ))
    return out
