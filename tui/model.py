"""What the screen shows, computed from one refresh of head data. Pure functions, no Textual.

Rank state (the table's last column):

- ``evicted``: the head says the rank finished, and its ``exit`` event says evicted or an applied, non-dry-run evict
  action named its node;
- ``failed``: the head says the rank finished, and its ``exit`` event gives an error as the reason;
- ``done``: the rank (or run) finished normally (a run a user instrumented, without ``ranksight launch``, ends
  this way too: each rank's ``exit`` event);
- ``stale``: the head reports the rank ``stalled`` (no record for much longer than its own step time);
- ``waiting``: in the manifest, no record yet; ``ended`` instead when the run is over;
- ``slow``: its median compute time over the window is ``SLOW_RATIO``x the median of all ranks,
  or it is a culprit;
- ``ok``: otherwise.

Culprits are the ranks (and the ranks of the nodes) named by the most severe findings present:
critical ones if there are any, otherwise warnings (info findings never make a culprit).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ranksight import schema
from tui.client import Fetched, GpuState, RankState, RunSummary

SLOW_RATIO = 1.25
# Exit reasons that mean "ended as planned": the head's rule (analyzers.checks.hang.clean_exit), which the TUI may
# not import (it talks to the head over HTTP only).
CLEAN_EXIT = ("finished", "evicted", "stop_after")
# Run statuses of a run that is over (head/runs.py run_status): the header says so, not "running".
ENDED_STATUS = ("finished", "failed", "stopped")


def clean_exit(reason: str | None) -> bool:
    return reason is None or reason in CLEAN_EXIT or reason.startswith("finished")


@dataclass
class RankRow:
    rank: int
    node: int | None
    host: str
    stage: int | None
    last_step: int | None
    step_ms: float | None
    compute_ms: float | None
    comm_ms: float | None
    data_ms: float | None
    age_s: float | None
    state: str
    culprit: bool = False
    exit_reason: str | None = None


@dataclass
class RunView:
    run_id: str
    run: RunSummary | None
    rows: list[RankRow]
    step: int | None
    tokens_per_s: float | None
    tflops_per_rank: float | None  # achieved, mean over ranks
    mfu: float | None
    peak_label: str
    peak_simulated: bool
    gpu_simulated: bool
    steps: list[int]  # heat map columns (oldest first)
    heat: dict[int, list[float | None]]  # rank -> compute_ms per step in ``steps``
    step_ms_series: list[float]
    loss_series: list[float]
    findings: list[schema.Finding]
    actions: list[schema.Action]
    culprits: set[int] = field(default_factory=set)
    skipped: dict[str, int] = field(default_factory=dict)
    dry_run_head: bool | None = None
    gpus: list[GpuState] | None = None  # None: the head has no GPU endpoint
    history: dict[int, list[schema.StepRecord]] = field(default_factory=dict)  # rank -> its records in the window

    @property
    def ended(self) -> bool:
        """The head says the run is over (finished, failed, or no records for a while)."""
        return self.run is not None and self.run.status in ENDED_STATUS


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def culprit_ranks(findings: list[schema.Finding], rank_nodes: dict[int, int | None]) -> set[int]:
    """Ranks named by the most severe findings present (critical if any, else warning; never info).

    The head appends findings and does not close them, so an old warning stays in the list after
    the rank recovered; highlighting only the top severity keeps "the culprit" to the worst problem.
    """
    top = max((schema.SEVERITY_ORDER.get(f.severity, 0) for f in findings), default=0)
    if top < schema.SEVERITY_ORDER["warning"]:
        return set()
    out: set[int] = set()
    for f in findings:
        if schema.SEVERITY_ORDER.get(f.severity, 0) < top:
            continue
        out.update(f.ranks)
        if not f.ranks:
            out.update(r for r, n in rank_nodes.items() if n is not None and n in f.nodes)
    return out


def evicted_nodes(actions: list[schema.Action]) -> set[int]:
    return {a.node for a in actions if a.action == "evict" and a.status == "applied" and not a.dry_run
            and a.node is not None}


def build_view(run_id: str, data: Fetched, window: int = 60) -> RunView:
    run = data.run
    # One record per (rank, step): after a restart the newest attempt's.
    latest: dict[tuple[int, int], schema.StepRecord] = {}
    for s in sorted(data.steps, key=lambda s: s.attempt):
        latest[(s.rank, s.step)] = s
    # Steps an older attempt ran past the point the newest attempt resumed from are superseded.
    newest_attempt: dict[int, tuple[int, int]] = {}  # rank -> (attempt, its first step)
    for (r, k), s in latest.items():
        a = newest_attempt.get(r)
        if a is None or s.attempt > a[0] or (s.attempt == a[0] and k < a[1]):
            newest_attempt[r] = (s.attempt, k)
    steps = sorted((s for s in latest.values() if s.attempt == newest_attempt[s.rank][0]
                    or s.step < newest_attempt[s.rank][1]), key=lambda s: (s.step, s.rank))
    by_rank: dict[int, list[schema.StepRecord]] = {}
    for s in steps:
        by_rank.setdefault(s.rank, []).append(s)
    states: dict[int, RankState] = {r.rank: r for r in data.ranks}
    all_ranks = sorted(set(states) | set(by_rank))
    rank_nodes = {r: (states[r].node if r in states and states[r].node is not None
                      else (by_rank[r][-1].node if r in by_rank else None)) for r in all_ranks}
    culprits = culprit_ranks(data.findings, rank_nodes)
    evicted = evicted_nodes(data.actions)

    med_compute = {r: _median([s.compute_ms for s in by_rank.get(r, [])[-10:]]) for r in all_ranks}
    overall = _median([v for v in med_compute.values() if v is not None])
    rows = []
    for r in all_ranks:
        st = states.get(r)
        last = by_rank.get(r, [])[-1] if by_rank.get(r) else None
        head_state = st.state if st else "running"
        node = rank_nodes[r]
        if head_state == "finished":
            reason = st.exit_reason if st else None
            state = ("evicted" if node in evicted or reason == "evicted" else "done" if clean_exit(reason)
                     else "failed")
        elif head_state == "stalled":
            state = "stale"
        elif head_state == "waiting":
            # an ended run's rank the head holds no record of (a head restarted on the store keeps no live window):
            # not "waiting" for anything
            state = "ended" if run is not None and run.status in ENDED_STATUS else "waiting"
        elif r in culprits or (overall and med_compute[r] is not None and med_compute[r] > SLOW_RATIO * overall):
            state = "slow"
        else:
            state = "ok"
        rows.append(RankRow(
            rank=r, node=node, host=(st.host if st and st.host else (last.host if last else "")),
            stage=last.pp_stage if last else None,
            last_step=st.step if st and st.step is not None else (last.step if last else None),
            step_ms=last.step_ms if last else (st.step_ms if st else None),
            compute_ms=last.compute_ms if last else None, comm_ms=last.comm_ms if last else None,
            data_ms=last.data_ms if last else None, age_s=st.age_s if st else None, state=state,
            culprit=r in culprits, exit_reason=st.exit_reason if st else None))

    # Per step, over the window: step time (max over ranks: the job waits for the slowest), loss (mean).
    per_step: dict[int, list[schema.StepRecord]] = {}
    for s in steps:
        per_step.setdefault(s.step, []).append(s)
    steps_sorted = sorted(per_step)[-window:]
    first = steps_sorted[0] if steps_sorted else 0
    history = {r: [s for s in recs if s.step >= first] for r, recs in by_rank.items()}
    step_ms_series = [max(s.step_ms for s in per_step[k]) for k in steps_sorted]
    loss_series = []
    for k in steps_sorted:
        ls = [s.loss for s in per_step[k] if s.loss is not None and not s.loss_nonfinite and math.isfinite(s.loss)]
        if ls:
            loss_series.append(sum(ls) / len(ls))
    heat = {r: [] for r in all_ranks}
    for k in steps_sorted:
        got = {s.rank: s.compute_ms for s in per_step[k]}
        for r in all_ranks:
            heat[r].append(got.get(r))

    # Throughput and MFU from the last few complete steps (every reporting rank present).
    layout = run.layout if run else {}
    tp, pp = int(layout.get("tp") or 1), int(layout.get("pp") or 1)
    n_ranks = len(by_rank)
    complete = [k for k in steps_sorted if len(per_step[k]) >= n_ranks][-5:]
    tokens_per_s = tflops = mfu = None
    if complete:
        tps, fps = [], []
        for k in complete:
            recs = per_step[k]
            step_s = max(s.step_ms for s in recs) / 1000.0
            if step_s > 0:
                # Each rank of a tp x pp group records its replica's tokens: count a replica once.
                tps.append(sum(s.tokens for s in recs) / (tp * pp) / step_s)
            fps.extend(s.flops / (s.step_ms / 1000.0) for s in recs if s.step_ms > 0)
        tokens_per_s = _median(tps)
        achieved = sum(fps) / len(fps) if fps else None
        tflops = achieved / 1e12 if achieved is not None else None
        if achieved is not None and run and run.peak_flops:
            mfu = achieved / run.peak_flops

    peak_sim = bool(run and (run.peak_simulated or ("measured" in run.peak_source.lower()
                                                    and "cpu" in run.peak_source.lower())))
    if run and run.peak_flops:
        src = run.peak_source or "source not stated"
        peak_label = f"peak {run.peak_flops / 1e12:.2f} TFLOP/s ({src})"
        if peak_sim:
            peak_label += " — simulated/CPU-measured peak"
    else:
        peak_label = "MFU n/a: the head gives no peak FLOPs"
    gpu_sim = bool(run and (run.gpu_simulated or (run.gpu_simulated is None and run.device == "cpu"))) or any(
        f.simulated and f.kind == "gpu_health" for f in data.findings) or any(g.simulated for g in data.gpus or [])
    dry = data.health.get("dry_run") if isinstance(data.health, dict) else None
    steps_known = [r.last_step for r in rows if r.last_step is not None]
    return RunView(run_id=run_id, run=run, rows=rows, step=max(steps_known) if steps_known else (run.last_step if run else None),
                   tokens_per_s=tokens_per_s, tflops_per_rank=tflops, mfu=mfu, peak_label=peak_label,
                   peak_simulated=peak_sim, gpu_simulated=gpu_sim, steps=steps_sorted, heat=heat,
                   step_ms_series=step_ms_series, loss_series=loss_series,
                   findings=sorted(data.findings, key=lambda f: (-schema.SEVERITY_ORDER.get(f.severity, 0), -f.t)),
                   actions=sorted(data.actions, key=lambda a: -a.t), culprits=culprits, skipped=dict(data.skipped),
                   dry_run_head=None if dry is None else bool(dry),
                   gpus=None if data.gpus is None else sorted(data.gpus, key=lambda g: (g.node, g.gpu)),
                   history=history)


def fmt_ms(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.1f}"


def fmt_age(v: float | None) -> str:
    if v is None:
        return "—"
    if v < 60:
        return f"{v:.1f}s"
    if v < 3600:
        return f"{v / 60:.0f}m"
    return f"{v / 3600:.1f}h"


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "—"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.2f}{unit}"
    return f"{v:.0f}"


def fmt_flops(v: float | None) -> str:
    if v is None:
        return "—"
    for unit, div in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if v >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.3g} FLOP/s"


def fmt_evidence_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(map(str, v[:8])) + f", … ({len(v)})]"
    return str(v)
