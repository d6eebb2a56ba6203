"""Checks over a run's data, the findings they produce, and the diagnose report.

The shape of PyTorch's flight-recorder analyzer, loader -> builder -> checks:

- ``analyzers.loader``: a run (the store, the spool files, or the head's live window) as a ``RunData`` of
  DataFrames;
- ``analyzers.builder``: ``build_frame(data)``, the ``AnalysisFrame`` of one analysis round: the rank x step
  matrices, references and placement maps the checks share, each computed once;
- ``analyzers.checks``: one module per kind of problem, ``analyze(frame, cfg) -> list[Finding]``.

:func:`run_all` chains them. The same code runs post-mortem (``diagnose``) and live on the head's sliding
window: build a :class:`~analyzers.loader.RunData` (``RunData.from_records``, ``now=time.time()``) and call
:func:`run_all`. Around them: ``analyzers.policy`` (the head's evict policy), ``analyzers.score`` (findings
against injected faults), ``analyzers.report`` and ``analyzers.diagnose`` (the post-mortem report).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from analyzers.builder import Coverage, build_frame
from analyzers.checks import CHECKS
from ranksight.schema import SEVERITY_ORDER

# Order of kinds at equal severity: causes before their consequences (an MFU drop is usually a symptom).
KIND_ORDER = {"hang": 0, "gpu_health": 1, "nccl_error": 1, "collective_mismatch": 1, "straggler": 2, "data_stall": 3,
              "comm_bottleneck": 4, "network_fallback": 4, "fp16_overflow": 5, "nan": 5, "pipeline_bubble": 6,
              "memory_pressure": 7, "mfu_drop": 8, "slowdown": 8, "benchmark": 9, "clock_skew": 9, "topology": 10}
ANALYZERS = tuple(CHECKS)


def run_all(data: Any, configs: dict[str, Any] | None = None, only: list[str] | None = None,
            errors: list[str] | None = None, coverage: list[Coverage] | None = None, jobs: int = 1) -> list:
    """Run every check on ``data`` (a RunData); findings sorted by severity, causes before symptoms, onset.

    ``configs`` maps a check's name (``ANALYZERS``) to its config object. A check that raises is skipped;
    its error goes to ``errors`` (when given) so one broken check never hides the others. ``coverage`` (when
    given) gets each check's :class:`~analyzers.builder.Coverage`: whether it could judge the run, and if not why
    (a check without the fields it needs finds nothing, which is not the same as finding the run healthy).
    ``jobs`` > 1: the checks run in that many processes forked from this one at a time (``analyzers.forked``;
    the same findings, in the same order).
    """
    configs = configs or {}
    findings = []
    now = data.now if getattr(data, "now", None) is not None else time.time()
    frame = build_frame(data)
    names = list(only or ANALYZERS)

    def run_one(name: str) -> tuple[list, tuple[str, Coverage] | None, Coverage | None]:
        """(findings, None, coverage) of one check; ([], (error, coverage), None) when it raised."""
        try:
            got = CHECKS[name].analyze(frame, configs.get(name))
        except Exception as e:  # noqa: BLE001 - keep the other checks' findings
            return [], (f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}",
                        Coverage(name, "error", f"the check failed: {type(e).__name__}: {e}")), None
        return got, None, _coverage_of(frame, name, configs.get(name))

    if jobs > 1 and len(names) > 1 and hasattr(os, "fork"):
        from analyzers.forked import run_forked

        done = run_forked(names, run_one, jobs)
        results = [done[name] for name in names]
    else:
        results = (run_one(name) for name in names)
    for got, error, cov in results:
        if error is not None:
            if errors is not None:
                errors.append(error[0])
            if coverage is not None:
                coverage.append(error[1])
            continue
        if coverage is not None:
            coverage.append(cov)
        for f in got:
            f.run_id = f.run_id or data.run_id
            f.t = f.t or now
        findings.extend(got)
    merge_corroborating(findings)
    _reconcile(findings)
    sort_findings(findings)
    return findings


def sort_findings(findings: list) -> None:
    """In place: by severity, causes before symptoms (KIND_ORDER), onset."""
    findings.sort(key=lambda f: (-SEVERITY_ORDER[f.severity], KIND_ORDER.get(f.kind, 99),
                                 f.step_start if f.step_start is not None else -1))


def check_coverage(data: Any, configs: dict[str, Any] | None = None, only: list[str] | None = None) -> list[Coverage]:
    """Each check's coverage of ``data`` (a RunData) without running the checks: what ``run_all(coverage=...)``
    gives, less the checks that would raise."""
    frame = build_frame(data)
    return [_coverage_of(frame, name, (configs or {}).get(name)) for name in only or ANALYZERS]


def _coverage_of(frame: Any, name: str, cfg: Any) -> Coverage:
    try:
        return CHECKS[name].coverage(frame, cfg)
    except Exception as e:  # noqa: BLE001 - coverage is a report, never a reason to stop the analysis
        return Coverage(name, "error", f"its coverage could not be judged: {type(e).__name__}: {e}")


# Straggler findings from device kernel time (trace summaries: ``kernel_time``; raw traces stored with a run:
# ``ranksight trace``'s checks, analyzer "trace") confirm the stragglers check's, in this order of preference.
STRAGGLER_SOURCES = ("stragglers", "kernel_time", "trace")


def _overlap(a: Any, b: Any) -> bool:
    a0 = a.step_start if a.step_start is not None else -(10**12)
    a1 = a.step_end if a.step_end is not None else 10**12
    b0 = b.step_start if b.step_start is not None else -(10**12)
    b1 = b.step_end if b.step_end is not None else 10**12
    return a0 <= b1 and b0 <= a1


def merge_corroborating(findings: list) -> None:
    """In place: one cause, one finding. A straggler finding from device kernel time (``kernel_time``, ``trace``)
    whose ranks are among those of a straggler finding from a preferred source (``STRAGGLER_SOURCES``) over
    overlapping steps is merged into it: its evidence goes under ``evidence[<its analyzer>]``, its inputs are added,
    and when it is confirmed (warning or worse) it confirms the other: severity and confidence rise to its own."""
    rank_of = {a: i for i, a in enumerate(STRAGGLER_SOURCES)}
    strag = sorted((f for f in findings if f.kind == "straggler" and f.analyzer in rank_of),
                   key=lambda f: rank_of[f.analyzer])
    gone: set[int] = set()
    for f in strag:
        if f.analyzer == STRAGGLER_SOURCES[0] or id(f) in gone:
            continue
        into = next((g for g in strag if id(g) not in gone and rank_of[g.analyzer] < rank_of[f.analyzer]
                     and f.ranks and set(f.ranks) <= set(g.ranks) and _overlap(f, g)), None)
        if into is None:
            continue
        gone.add(id(f))
        into.evidence = dict(into.evidence or {}, **{f.analyzer: dict(f.evidence or {}, severity=f.severity,
                                                                         steps=[f.step_start, f.step_end])})
        into.inputs = sorted(set(into.inputs) | set(f.inputs))
        if SEVERITY_ORDER[f.severity] >= 1:
            ex = (f.evidence or {}).get("excess_pct")
            span = f"step {f.step_start}" if f.step_start == f.step_end else f"steps {f.step_start}-{f.step_end}"
            into.summary += (f"; confirmed by device kernel time ({ex}% over its peers in {span}, profiler traces)"
                             if ex is not None else "; confirmed by device kernel time (profiler traces)")
            if SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[into.severity]:
                into.severity = f.severity
        into.confidence = max(into.confidence, f.confidence)
    if gone:
        findings[:] = [f for f in findings if id(f) not in gone]


# An MFU drop is a symptom; the cause it names must be confirmed by that cause's own check.
MFU_CAUSE_KIND = {"straggler": "straggler", "data_stall": "data_stall", "comm_growth": "comm_bottleneck",
                  "pipeline_wait": "pipeline_bubble"}


def _reconcile(findings: list) -> None:
    """An MFU drop is reported as info either way: as a *symptom* when a warning-or-worse finding of the kind it
    blames overlaps it (that finding is the one to act on, and carries the MFU cost in its evidence), or as
    *unconfirmed* when none does. One cause then reads as one warning, not one per window of its cost.

    (Clock throttle rests on GPU telemetry of its own and is kept.)"""
    for f in findings:
        if f.kind != "mfu_drop" or f.severity == "info":
            continue
        want = MFU_CAUSE_KIND.get((f.evidence or {}).get("cause", ""))
        if want is None:
            continue
        s0 = f.step_start if f.step_start is not None else -(10**9)
        s1 = f.step_end if f.step_end is not None else 10**9
        roots = [g for g in findings if g.kind == want and SEVERITY_ORDER[g.severity] >= 1
                 and (g.step_start is None or g.step_start <= s1) and (g.step_end is None or g.step_end >= s0)]
        f.severity = "info"
        if not roots:
            f.evidence = dict(f.evidence, cause_confirmed=False)
            f.summary += f" (no {want} finding confirms it)"
            continue
        root = max(roots, key=lambda g: SEVERITY_ORDER[g.severity])
        drop = (f.evidence or {}).get("drop")
        f.evidence = dict(f.evidence, cause_confirmed=True, symptom_of=dict(kind=root.kind, ranks=list(root.ranks),
                                                                           step_start=root.step_start))
        f.summary += f" (a symptom of the {root.kind} finding on rank(s) {', '.join(map(str, root.ranks))})"
        if drop is not None:
            root.evidence = dict(root.evidence, mfu_drop=max(drop, (root.evidence or {}).get("mfu_drop") or 0.0))


__all__ = ["ANALYZERS", "KIND_ORDER", "Coverage", "check_coverage", "merge_corroborating", "run_all"]
