"""Pipeline bubbles: measured pipeline wait per stage against the schedule's theory.

Theory (balanced stages, P stages, M micro-batches, V virtual stages per rank):
GPipe and 1F1B idle (P-1)/(M+P-1) of the schedule; interleaved 1F1B (P-1)/(V*M+P-1).
Measured bubble of a stage = pipeline_wait_ms / (compute_ms + pipeline_wait_ms): the share of the
pipeline schedule's span the stage sat waiting for its neighbours (data loading, optimizer and the
data-parallel gradient sync are outside the schedule and excluded).

Cause: when the measured bubble exceeds theory, compare stage compute: a stage computing
``imbalance_ratio`` x the median of the other stages is the cause (the others wait for it); otherwise the
bubble is the schedule's own (too few micro-batches), and the finding gives the smallest M that
brings theory under ``target``: M >= (P-1)(1-target) / (target*V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage
from analyzers.evidence import fnum
from analyzers.stats import few_group_medians
from ranksight.schema import Finding

NAME = "pipeline"


@dataclass
class PipelineConfig:
    target: float = 0.10  # bubble share a good configuration stays under
    theory_warn: float = 0.30  # schedule bubble (theory) at or above this is a warning: too few micro-batches
    theory_critical: float = 0.50
    excess_warn: float = 0.15  # measured - theory, absolute share, with an imbalanced stage
    imbalance_ratio: float = 1.25  # slowest stage compute / median compute of the other stages
    p2p_excess_warn: float = 0.30  # measured - theory with balanced stages (p2p latency; CPU gloo pays a lot)
    warmup_steps: int = 1


def theory_bubble(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    if p <= 1 or m <= 0:
        return 0.0
    sched = (schedule or "1f1b").lower()
    if "interleav" in sched:
        v = max(v, 1)
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def microbatches_for(p: int, target: float, schedule: str = "1f1b", v: int = 1) -> int:
    """Smallest M with theory_bubble(p, M) <= target."""
    if p <= 1:
        return 1
    v = v if "interleav" in (schedule or "").lower() else 1
    return max(1, math.ceil((p - 1) * (1 - target) / (target * max(v, 1)) - 1e-9))


def coverage(frame: AnalysisFrame, cfg: PipelineConfig | None = None) -> Coverage:
    """Can this check judge the run? Only a pipeline-parallel run has bubbles; it needs each rank's stage
    (``pp_stage``) and its measured p2p wait (``pipeline_wait_ms``)."""
    sig = frame.signals
    if sig.pp <= 1:
        return Coverage(NAME, "not_applicable", "no pipeline parallelism (pp=1)" if frame.data.manifest is not None
                        else "no pipeline stages in the step records (pp_stage): pp=1 assumed")
    if sig.pp_stages <= 1:
        return Coverage(NAME, "not_run", f"the layout has pp={sig.pp} but the step records carry no pp_stage")
    if not (frame.data.steps["pipeline_wait_ms"] > 0).any():
        return Coverage(NAME, "limited", ("no pipeline_wait_ms in the step records: the measured bubble is not known, "
                                          "only the schedule's theory"))
    return Coverage(NAME, "ran")


def analyze(frame: AnalysisFrame, cfg: PipelineConfig | None = None) -> list[Finding]:
    cfg = cfg or PipelineConfig()
    st = frame.data.steps
    if st.empty:
        return []
    layout = frame.data.layout
    p = int(layout.get("pp") or st["pp_stage"].nunique())
    if p <= 1 or st["pp_stage"].nunique() <= 1:
        return []
    st = frame.judged(cfg.warmup_steps).rows
    if st.empty:
        return []
    m = int(layout.get("microbatches") or int(st["microbatches"].median()) or 1)
    schedule = str(layout.get("pp_schedule") or "1f1b")
    v = int(layout.get("virtual_stages") or 1) if "interleav" in schedule.lower() else 1
    theory = theory_bubble(p, m, schedule, v)
    span = st["compute_ms"] + st["pipeline_wait_ms"]
    bubble = pd.Series(np.where(span > 0, st["pipeline_wait_ms"] / span.where(span > 0, 1), np.nan), index=st.index)
    # per stage (a few) over every judged row: groupby(pp_stage).median()'s values, without its sort of 10 M rows
    per_stage = few_group_medians(st["pp_stage"], dict(bubble=bubble, compute=st["compute_ms"],
                                                       wait=st["pipeline_wait_ms"]))
    measured = float(per_stage["bubble"].mean())
    excess = measured - theory
    med_compute = float(per_stage["compute"].median())
    slowest = int(per_stage["compute"].idxmax())
    others = per_stage["compute"].drop(index=slowest)
    ref_compute = float(others.median()) if not others.empty else med_compute
    imbalance = float(per_stage["compute"].max() / ref_compute) if ref_compute > 0 else 1.0
    m_needed = microbatches_for(p, cfg.target, schedule, v)
    ranks = sorted(int(r) for r in st["rank"].unique())
    s0, s1 = int(st["step"].min()), int(st["step"].max())
    ev = dict(pp=p, microbatches=m, virtual_stages=v, schedule=schedule, theory_bubble=fnum(theory, 3),
              measured_bubble=fnum(measured, 3), excess=fnum(excess, 3),
              stage_bubble={int(k): fnum(x, 3) for k, x in per_stage["bubble"].items()},
              stage_compute_ms={int(k): fnum(x, 1) for k, x in per_stage["compute"].items()},
              stage_wait_ms={int(k): fnum(x, 1) for k, x in per_stage["wait"].items()},
              imbalance_ratio=fnum(imbalance, 3), slowest_stage=slowest, target=cfg.target,
              microbatches_for_target=m_needed)
    out: list[Finding] = []
    if excess >= cfg.excess_warn and imbalance >= cfg.imbalance_ratio:
        stage_ranks = sorted(int(r) for r in st.loc[st["pp_stage"] == slowest, "rank"].unique())
        out.append(Finding(
            analyzer=NAME, kind="pipeline_bubble", severity="warning", ranks=stage_ranks, nodes=frame.placement.nodes_of(stage_ranks),
            step_start=s0, step_end=s1, evidence=dict(ev, cause="imbalanced_stage"), confidence=0.8,
            summary=(f"pipeline bubble {measured:.0%} vs {theory:.0%} in theory (P={p}, M={m}): stage {slowest} computes "
                     f"{imbalance:.2f}x the median stage and the others wait for it"),
            recommendation=(f"Rebalance the layers across stages (move layers off stage {slowest}) or check its hosts; "
                            f"more micro-batches cannot hide an imbalanced stage."),
        ))
    elif excess >= cfg.excess_warn:
        out.append(Finding(
            analyzer=NAME, kind="pipeline_bubble", severity="warning" if excess >= cfg.p2p_excess_warn else "info", ranks=ranks, nodes=frame.placement.nodes_of(ranks),
            step_start=s0, step_end=s1, evidence=dict(ev, cause="p2p_latency"), confidence=0.6,
            summary=(f"pipeline bubble {measured:.0%} vs {theory:.0%} in theory (P={p}, M={m}) with balanced stages: "
                     f"point-to-point transfers between stages are slow"),
            recommendation="Check the links between pipeline stages (place neighbouring stages on one node, nccl-tests send/recv).",
        ))
    elif theory >= cfg.theory_warn:
        sev = "critical" if theory >= cfg.theory_critical else "warning"
        out.append(Finding(
            analyzer=NAME, kind="pipeline_bubble", severity=sev, ranks=ranks, nodes=frame.placement.nodes_of(ranks),
            step_start=s0, step_end=s1, evidence=dict(ev, cause="too_few_microbatches"), confidence=0.9,
            summary=(f"pipeline bubble {measured:.0%} (theory {theory:.0%} for P={p}, M={m}, {schedule}): too few micro-batches; "
                     f"M >= {m_needed} would bring it under {cfg.target:.0%}"),
            recommendation=(f"Raise micro-batches to M >= {m_needed} (same global batch, smaller micro-batch) to bring the bubble under "
                            f"{cfg.target:.0%}" + ("" if "interleav" in schedule.lower() else ", or use an interleaved schedule") + "."),
        ))
    elif theory > cfg.target:
        out.append(Finding(
            analyzer=NAME, kind="pipeline_bubble", severity="info", ranks=ranks, nodes=frame.placement.nodes_of(ranks),
            step_start=s0, step_end=s1, evidence=dict(ev, cause="schedule"), confidence=0.9,
            summary=f"pipeline bubble {measured:.0%} (theory {theory:.0%} for P={p}, M={m}); M >= {m_needed} would reach {cfg.target:.0%}",
            recommendation=f"Consider M >= {m_needed} micro-batches to bring the bubble under {cfg.target:.0%}.",
        ))
    return out
