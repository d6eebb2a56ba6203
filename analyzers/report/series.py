"""The series behind the report's plots, derived from a run's records once (``plot_data``), and the events every
time axis marks. Nothing here draws: ``analyzers.report.plots`` does. A series the records cannot give is left
empty and ``PlotData.missing`` says why, so the page can say it in one line instead of drawing a blank plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd

from analyzers.loader import RunData
from analyzers.stats import few_group_medians
from ranksight.schema import SEVERITY_ORDER, Finding

# the per-rank time split, as the step records book it (StepRecord's fields), in the order the bars stack
TIME_PARTS = (("compute_ms", "compute"), ("comm_ms", "comm (exposed)"), ("data_ms", "data"),
              ("pipeline_wait_ms", "pipeline wait"))
TRAINING_CURVES = (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"))
GPU_METRICS = (("sm_clock_mhz", "SM clock (MHz)"), ("temp_c", "temperature (°C)"))
# group order when several carry arrival times: the gradient sync first
SYNC_GROUPS = ("dp", "world", "tp", "pp")
# A plot of many ranks (or GPUs) draws FOCUS_K of them one by one, those the findings name first, then the most
# extreme, and the rest as one band (p5-p95 and the median): thousands of lines are neither readable nor cheap.
FOCUS_K = 6
BAND_QUANTILES = (0.05, 0.5, 0.95)


@dataclass
class Event:
    """Something that happened at a step, marked on every time axis."""

    step: int
    kind: str  # fault | finding | evict | restart | checkpoint | profile
    label: str  # what the legend under the plots says


@dataclass
class PipelineStage:
    stage: int
    forward_ms: float  # one micro-batch's forward on this stage (median step's forward time / micro-batches)
    backward_ms: float
    wait_ms: float  # the stage's measured pipeline wait per step (median)
    compute_ms: float  # per step (median)


@dataclass
class PlotData:
    """What the plots draw. Frames are indexed by step; an empty one means the plot is left out (``missing``)."""

    events: list[Event] = field(default_factory=list)
    stacked: pd.DataFrame = field(default_factory=pd.DataFrame)  # rank x TIME_PARTS labels: median ms per step
    arrival_lag: pd.DataFrame = field(default_factory=pd.DataFrame)  # step x rank: ms after the step's first rank
    arrival_source: str = ""
    gpu: dict[str, pd.DataFrame] = field(default_factory=dict)  # GPU_METRICS label -> step x "node N GPU G"
    gpu_simulated: bool = False
    training: pd.DataFrame = field(default_factory=pd.DataFrame)  # step x TRAINING_CURVES labels (median over ranks)
    overflow_steps: list[int] = field(default_factory=list)  # fp16: steps whose gradients overflowed
    collectives: pd.DataFrame = field(default_factory=pd.DataFrame)  # step x "op on group": transfer ms
    pipeline: list[PipelineStage] = field(default_factory=list)
    pipeline_schedule: str = ""
    microbatches: int = 1
    virtual_stages: int = 1
    missing: dict[str, str] = field(default_factory=dict)  # plot id -> why it is left out
    # the ranks and nodes the warning-or-worse findings name, most severe first: a plot of many draws these one by one
    focus_ranks: list[int] = field(default_factory=list)
    focus_nodes: list[int] = field(default_factory=list)


def plot_data(data: RunData, findings: list[Finding], hist: dict[str, Any], injected: list[Event] | None = None) -> PlotData:
    """Every plot's series for ``data``; ``findings``, the job's history ``hist`` and the ``injected`` faults' marks
    (``model.fault_events``: only the report's fault table code reads the fault spec) give the event marks."""
    pd_ = PlotData(events=events(findings, hist, injected or []))
    pd_.focus_ranks, pd_.focus_nodes = named_by(findings)
    _stacked(data, pd_)
    _arrival(data, pd_)
    _gpu(data, pd_)
    _training(data, pd_)
    _collectives(data, pd_)
    _pipeline(data, pd_)
    return pd_


def events(findings: list[Finding], hist: dict[str, Any], injected: list[Event]) -> list[Event]:
    """The marks of the time axes, in step order: the ``injected`` faults (the manifest's ground truth), each
    warning-or-worse finding's onset (symptoms of another finding left out), and what happened to the job (actions,
    restarts)."""
    out: list[Event] = list(injected)
    seen = set()
    for f in findings:
        if SEVERITY_ORDER[f.severity] < 1 or f.evidence.get("symptom_of"):
            continue
        onset = f.evidence.get("onset_step", f.step_start)
        if onset is None or (f.kind, onset) in seen:
            continue
        seen.add((f.kind, onset))
        ranks = f", rank{'s' if len(f.ranks) > 1 else ''} {_list(f.ranks)}" if 0 < len(f.ranks) <= 8 else ""
        out.append(Event(int(onset), "finding", f"{f.kind.replace('_', ' ')} found from here ({f.severity}{ranks})"))
    for a in hist.get("actions", []):
        if a.get("applied_step") is None or a.get("dry_run") or a.get("status") != "applied":
            continue
        node = f" node {a['node']}" if a.get("node") is not None else ""
        kind = a["action"] if a["action"] in ("evict", "checkpoint", "profile") else "action"
        out.append(Event(int(a["applied_step"]), kind, f"{a['action']}{node} (by {a.get('requested_by') or 'unknown'})"))
    for a in hist.get("attempts", []):
        if a.get("resumed_step") is not None:
            out.append(Event(int(a["resumed_step"]), "restart",
                             f"restart: attempt {a.get('attempt')} on {a.get('world_size')} ranks from step {a['resumed_step']}"))
    return sorted(out, key=lambda e: e.step)


def named_by(findings: list[Finding]) -> tuple[list[int], list[int]]:
    """The ranks and the nodes the warning-or-worse findings name, most severe first, each once."""
    ranks: list[int] = []
    nodes: list[int] = []
    for f in sorted(findings, key=lambda f: -SEVERITY_ORDER[f.severity]):
        if SEVERITY_ORDER[f.severity] < 1:
            continue
        ranks += [int(r) for r in f.ranks if int(r) not in ranks]
        nodes += [int(n) for n in f.nodes if int(n) not in nodes]
    return ranks, nodes


def focus(scores: pd.Series, prefer: Sequence[Any] = (), k: int = FOCUS_K) -> list[Any]:
    """The ``k`` labels of ``scores`` to draw one by one: those in ``prefer`` first (in its order), then the highest
    scores (ties in label order; NaN last)."""
    out = [x for x in prefer if x in scores.index][:k]
    for x in scores.sort_values(ascending=False, kind="stable", na_position="last").index:
        if len(out) >= k:
            break
        if x not in out:
            out.append(x)
    return out


def band(frame: pd.DataFrame, exclude: Sequence[Any] = ()) -> pd.DataFrame:
    """Per row of ``frame`` (a step), the BAND_QUANTILES over its columns but ``exclude``: columns ``p5``, ``median``,
    ``p95``; rows where no column has a value are dropped."""
    a = frame.to_numpy(dtype=float)[:, ~frame.columns.isin(list(exclude))]  # not DataFrame.drop: slow when wide
    keep = ~np.isnan(a).all(axis=1)
    q = np.full((len(a), len(BAND_QUANTILES)), np.nan)
    if keep.any():
        q[keep] = np.nanquantile(a[keep], BAND_QUANTILES, axis=1).T
    out = pd.DataFrame(q, index=frame.index, columns=["p5", "median", "p95"])
    return out[keep]


def _list(xs: list[int]) -> str:
    return ",".join(str(x) for x in sorted(xs))


def _stacked(data: RunData, out: PlotData) -> None:
    cols = [c for c, _ in TIME_PARTS if c in data.steps and data.steps[c].notna().any()]
    parts = data.steps.groupby("rank")[cols].median() if cols else pd.DataFrame()
    if parts.empty or not (parts.fillna(0).to_numpy() > 0).any():
        out.missing["ranktime"] = "the step records book no compute, comm, data or pipeline-wait time"
        return
    out.stacked = parts.rename(columns=dict(TIME_PARTS)).fillna(0.0)


def _arrival(data: RunData, out: PlotData) -> None:
    """Each rank's arrival at the step's gradient sync, in ms after the step's first rank: from the step records'
    sync_arrival, else from the collective records' t_arrive on the sync group (its first collective per step)."""
    st = data.steps
    if "sync_arrival" in st and st["sync_arrival"].notna().any():
        rows = st.loc[st["sync_arrival"].notna(), ["attempt", "step", "rank", "sync_arrival"]].rename(
            columns={"sync_arrival": "t"})
        out.arrival_source = "the step records' sync_arrival (the time each rank reached the gradient sync)"
    else:
        c = data.collectives
        groups = [g for g in SYNC_GROUPS if not c.empty and (c["group"] == g).any()]
        if not groups:
            out.missing["arrival"] = "no record says when a rank reached a collective (no sync_arrival, no collective records)"
            return
        c = c[c["group"] == groups[0]].sort_values("seq")
        rows = c.groupby(["attempt", "step", "rank"], as_index=False)["t_arrive"].first().rename(columns={"t_arrive": "t"})
        out.arrival_source = f"the collective records' t_arrive (the first collective of group {groups[0]} in each step)"
    if rows["rank"].nunique() < 2:
        out.missing["arrival"] = "only one rank reports arrivals: there is nobody to arrive late against"
        return
    rows = rows.assign(lag=(rows["t"] - rows.groupby(["attempt", "step"])["t"].transform("min")) * 1000.0)
    out.arrival_lag = rows.pivot_table(index="step", columns="rank", values="lag", aggfunc="last").sort_index()


def step_spans(data: RunData) -> pd.DataFrame:
    """Each step's wall-clock span (first rank's start, last rank's end), per attempt: the bins GPU samples fall in."""
    sp = data.steps.groupby(["attempt", "step"], as_index=False).agg(t0=("t_start", "min"), t1=("t_end", "max"))
    return sp.sort_values("t0").reset_index(drop=True)


def _gpu(data: RunData, out: PlotData) -> None:
    g = data.gpu
    metrics = [(c, lbl) for c, lbl in GPU_METRICS if not g.empty and c in g and g[c].notna().any()]
    if not metrics:
        out.missing["gpu"] = ("no GPU samples in this run" if g.empty else
                              "the GPU samples carry neither SM clock nor temperature")
        return
    spans = step_spans(data)
    samples = g.dropna(subset=["t"]).sort_values("t")
    binned = pd.merge_asof(samples, spans, left_on="t", right_on="t0", direction="backward")
    binned = binned[binned["t1"].notna() & (binned["t"] <= binned["t1"])]
    if binned.empty:
        out.missing["gpu"] = "no GPU sample falls inside a step's time span (clocks apart, or sampled outside the run)"
        return
    binned = binned.assign(gpu_name="node " + binned["node"].astype(int).astype(str) + " GPU " + binned["gpu"].astype(int).astype(str))
    for col, label in metrics:
        piv = binned.pivot_table(index="step", columns="gpu_name", values=col, aggfunc="median").sort_index()
        if not piv.empty:
            out.gpu[label] = piv
    out.gpu_simulated = bool(g["simulated"].fillna(False).astype(bool).any()) if "simulated" in g else False


def _training(data: RunData, out: PlotData) -> None:
    st = data.steps
    cols = {c: lbl for c, lbl in TRAINING_CURVES if c in st and st[c].notna().any()}
    if not cols:
        out.missing["training"] = "the step records carry no loss, grad norm or loss scale"
        return
    out.training = st.groupby("step")[list(cols)].median().rename(columns=cols).sort_index()
    if "overflow" in st:
        out.overflow_steps = sorted(int(s) for s in st.loc[st["overflow"].fillna(False).astype(bool), "step"].unique())


def _collectives(data: RunData, out: PlotData) -> None:
    """Per step and communicator (op on group): the time from the last member's arrival to completion, i.e. the
    transfer itself (waiting for a late rank is the arrival lag plot's); median over the step's collectives."""
    c = data.collectives
    if c.empty:
        out.missing["collectives"] = "no collective records in this run"
        return
    c = c[c["t_done"].notna()]
    if c.empty:
        out.missing["collectives"] = "no collective completed (every record lacks t_done)"
        return
    per = c.groupby(["attempt", "group", "op", "step", "seq"], as_index=False).agg(
        last=("t_arrive", "max"), done=("t_done", "median"))
    per = per.assign(ms=((per["done"] - per["last"]) * 1000.0).clip(lower=0.0),
                     name=per["op"].astype(str) + " on " + per["group"].astype(str))
    out.collectives = per.pivot_table(index="step", columns="name", values="ms", aggfunc="median").sort_index()


def _pipeline(data: RunData, out: PlotData) -> None:
    lay = data.manifest.layout if data.manifest is not None and data.manifest.layout else data.inferred_layout()
    st = data.steps
    stages = sorted(int(s) for s in st["pp_stage"].unique()) if "pp_stage" in st else []
    if int(lay.get("pp") or 1) <= 1 and len(stages) <= 1:
        out.missing["pipeline"] = "no pipeline parallelism in this run (pp = 1)"
        return
    if len(stages) <= 1:
        out.missing["pipeline"] = "the layout says pp > 1 but the step records name one pipeline stage"
        return
    m = int(lay.get("microbatches") or (st["microbatches"].median() if "microbatches" in st else 1) or 1)
    out.microbatches = max(1, m)
    out.virtual_stages = int(lay.get("virtual_stages") or 1)
    out.pipeline_schedule = str(lay.get("pp_schedule") or "1f1b")
    # per stage (a few) over every row: groupby(pp_stage).median()'s values without its sort of every row by stage
    med = few_group_medians(st["pp_stage"], {c: st[c] for c in ("forward_ms", "backward_ms", "compute_ms",
                                                                "pipeline_wait_ms")})
    for s in stages:
        row = med.loc[s]
        fwd, bwd = float(row["forward_ms"]), float(row["backward_ms"])
        if not (fwd > 0 or bwd > 0):  # no forward/backward split recorded: the usual 1:2 of the compute time
            fwd, bwd = float(row["compute_ms"]) / 3, float(row["compute_ms"]) * 2 / 3
        out.pipeline.append(PipelineStage(stage=s, forward_ms=fwd / out.microbatches, backward_ms=bwd / out.microbatches,
                                          wait_ms=float(row["pipeline_wait_ms"]), compute_ms=float(row["compute_ms"])))


def schedule(stages: list[PipelineStage], microbatches: int, kind: str = "1f1b") -> list[tuple[int, str, int, float, float]]:
    """(stage, "F"|"B", micro-batch, start ms, end ms) of one step's pipeline, replayed from each stage's forward and
    backward time per micro-batch: a micro-batch's forward on stage s follows its forward on s-1, its backward on s
    follows its backward on s+1, and each stage runs its ops in the schedule's order (GPipe: all forwards, then all
    backwards; 1F1B: P-s-1 warm-up forwards, then one forward and one backward in turn)."""
    p, m = len(stages), microbatches
    order: list[list[tuple[str, int]]] = []
    for s in range(p):
        if kind.lower() == "gpipe":
            ops = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        else:
            warm = min(p - s - 1, m)
            ops = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                if f < m:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
                b += 1
        order.append(ops)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    out = []
    while any(pos[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] >= len(order[s]):
                continue
            op, i = order[s][pos[s]]
            dep = (s - 1, "F", i) if op == "F" and s > 0 else (s + 1, "B", i) if op == "B" and s < p - 1 else None
            if op == "B" and s == p - 1:
                dep = (s, "F", i)
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0) if dep is not None else 0.0)
            dur = stages[s].forward_ms if op == "F" else stages[s].backward_ms
            end = start + max(dur, 0.0)
            done[(s, op, i)] = end
            free[s] = end
            pos[s] += 1
            out.append((stages[s].stage, op, i, start, end))
            moved = True
        if not moved:  # an order that cannot make progress: stop rather than spin
            break
    return out


def bubble_share(ops: list[tuple[int, str, int, float, float]]) -> float:
    """The idle share of the replayed step: 1 - busy / (stages x makespan)."""
    if not ops:
        return float("nan")
    span = max(o[4] for o in ops) - min(o[3] for o in ops)
    stages = {o[0] for o in ops}
    busy = sum(o[4] - o[3] for o in ops)
    return float(1 - busy / (len(stages) * span)) if span > 0 else float("nan")


def finite(values: Any) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    return a[np.isfinite(a)]
