"""What the diagnose report says about a run, independent of how it is shown.

``build_report(data, findings, errors, coverage)`` gathers it once: the verdict, the findings, which checks could
not judge the run and why (``coverage``), the injected faults next to what was found, the job's history (restarts
and the head's actions), and the series the plots draw (compute per rank and step, MFU and step time per step).
The renderers (``render_text``, ``render_json``, ``render_html``) only lay it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict

import msgspec
import numpy as np
import pandas as pd

from analyzers import check_coverage
from analyzers.builder import Coverage, Placement
from analyzers.checks.mfu import peak_label, series
from analyzers.loader import RunData
from analyzers.matrices import step_grid
from analyzers.report.heat import RankStepMatrix, rank_step_matrix
from analyzers.report.series import Event, PlotData, band, events, focus, plot_data
from analyzers.score import detection_step, matches
from analyzers.trace_windows import grouped, trace_windows
from ranksight.exit_codes import (EXIT, EXIT_CODES_HELP, EXIT_CRITICAL, EXIT_HEALTHY,  # noqa: F401 (re-exported)
                                   EXIT_INCOMPLETE, EXIT_LOAD_ERROR, EXIT_WARNING)
from ranksight.schema import SEVERITY_ORDER, Finding

FINDING_FIELDS = ("analyzer", "kind", "severity", "ranks", "nodes", "step_start", "step_end", "evidence",
                  "recommendation", "confidence", "summary", "simulated", "hosts", "gpus", "inputs")
# diagnose's exit codes: ranksight.exit_codes (shared with `ranksight logs` and `ranksight trace`)
# a check in these states could not judge the run
NOT_RUN = ("not_run", "error")
HEAT_ROWS = 48  # heat map rows: more ranks than this and the rest are summarized (heat_view)
HEAT_FOCUS = 12  # then this many ranks keep their own row
TRACE_WINDOWS = 3  # profiler capture windows the report shows (the newest)
TRACE_ROWS = 32  # a capture window's table: more ranks than this and the ones furthest above the median are shown
TRACE_COLUMNS = ("rank", "node", "kernel ms/step", "vs median", "NCCL ms/step", "exposed comm ms/step",
                 "memcpy/set ms/step", "idle %", "trace")


class Summary(TypedDict):
    """The report as one JSON object (``diagnose --json`` prints it as is, in this key order)."""

    run_id: str
    verdict: str  # one sentence: HEALTHY, INCOMPLETE (checks could not run), or the worst finding (and the evictions)
    findings: list[dict[str, Any]]  # FINDING_FIELDS of each finding, most severe first
    coverage: list[dict[str, Any]]  # each check's {check, ran, status, reason} (analyzers.builder.Coverage)
    checks_not_run: list[str]  # the checks that could not judge the run (status not_run or error)
    faults: list[dict[str, Any]]  # each injected fault (the manifest's ground truth): found, by which finding, how late
    history: dict[str, Any]  # attempts (restarts, from the manifest) and actions (the head's, with their status)
    traces: list[dict[str, Any]]  # the last TRACE_WINDOWS profiler capture windows, per rank (analyzers.trace_windows)
    simulated: bool  # parts rest on simulated GPU telemetry or a CPU-measured peak
    worst_severity: str | None
    exit_code: int
    steps: list[int]  # first and last step
    ranks: list[int]
    nodes: list[int]
    world_size: int  # the manifest's, else the step records' world_size
    layout: dict[str, Any]  # the layout the run started with
    peak: str  # the peak FLOP/s MFU is measured against, and where it comes from
    mfu_median: float | None
    step_ms_median: float | None
    source: str  # store | spool
    truncated_lines: int
    bad_lines: int
    damaged_parts: int  # store part files that failed to read (page checksum, torn): their rows are missing
    analyzer_errors: list[str]
    # the marks of the report's time axes: {step, kind (fault | finding | evict | restart | checkpoint | profile), label}
    events: list[dict[str, Any]]


@dataclass
class DiagnoseReport:
    """Everything a renderer shows: the summary and the series behind the plots."""

    summary: Summary
    platform: str | None  # "backend/device" from the manifest (None without one)
    compute_label: str  # what ``compute`` measures, as the heat map's title says it
    # rank x step: each rank's compute signal per step (``cells``; ``compute`` as a frame), made on first use: the text
    # and HTML reports draw it, the JSON one does not (a copy of every step record's signal on a big run)
    cells_of: Callable[[], RankStepMatrix]
    over_time: pd.DataFrame  # per step: step_ms, tflops, mfu (analyzers.checks.mfu.series)
    plots: PlotData = field(default_factory=PlotData)  # the other plots' series and the events (analyzers.report.series)
    rank_node: dict[int, int] = field(default_factory=dict)  # each rank's node (the placement), for "rank 3 (node 1)"
    _cells: RankStepMatrix | None = field(default=None, init=False, repr=False)

    @property
    def cells(self) -> RankStepMatrix:
        if self._cells is None:
            self._cells = self.cells_of()
        return self._cells

    @property
    def compute(self) -> pd.DataFrame:
        """Rank x step: each rank's compute signal per step (a frame of ``cells``; big on a big run)."""
        return self.cells.frame()

    def heat_map(self, max_cols: int) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
        """Rank x step-bucket matrix of each rank's median compute signal (at most ``max_cols`` buckets), and each
        bucket's (first, last) step."""
        return self.cells.bucket_medians(max_cols)

    def heat_view(self, max_cols: int, max_rows: int = HEAT_ROWS) -> "HeatView":
        """``heat_map(max_cols)`` with at most ``max_rows`` rows: every rank when they fit; else the ranks the findings
        name and those most out of line with their step's median (at any step), then the other ranks' p95, median
        and p5 per step bucket. Colours compare with the median over all ranks either way."""
        heat, spans = self.heat_map(max_cols)
        med = heat.median(axis=0) if not heat.empty else pd.Series(dtype=float)
        if len(heat) <= max_rows:
            return HeatView(heat, spans, med, {r: f"rank {r}" for r in heat.index}, 0)
        score = heat.div(med.where(med > 0), axis=1).max(axis=1)
        top = focus(score, self.plots.focus_ranks, max(1, min(HEAT_FOCUS, max_rows - 3)))
        q = band(heat.T, top).T  # rows p5, median, p95 over the other ranks, per bucket
        rows = pd.concat([heat.loc[top], q.loc[["p95", "median", "p5"]]])
        others = len(heat) - len(top)
        labels: dict[Any, str] = {r: f"rank {r}" for r in top}
        labels.update({k: f"others' {k}" for k in ("p95", "median", "p5")})
        return HeatView(rows, spans, med, labels, others)


@dataclass
class HeatView:
    """The heat map as drawn: ``rows`` (rank or band row x step bucket), each bucket's ``spans`` (first, last step),
    the bucket ``median`` over all ranks (what the colours compare with), each row's ``labels`` and how many ranks
    the band rows stand for (``others``: 0 when every rank has its row)."""

    rows: pd.DataFrame
    spans: list[tuple[int, int]]
    median: pd.Series
    labels: dict[Any, str]
    others: int


@dataclass
class StepRows:
    """What the report reads off every step record, worked out once: the step x rank grid (``step_grid``; None where
    the records are not one), the distinct ranks and nodes, sorted."""

    grid: tuple[np.ndarray, np.ndarray] | None
    ranks: list[int]
    nodes: list[int]

    @classmethod
    def of(cls, st: pd.DataFrame) -> "StepRows":
        grid = step_grid(st["rank"].to_numpy(), st["step"].to_numpy()) if not st.empty else None
        if grid is None:
            return cls(None, sorted(int(r) for r in st["rank"].unique()), sorted(int(n) for n in st["node"].unique()))
        ranks = grid[0]  # ascending, each once: the ranks of every step
        node = st["node"].to_numpy()
        n = len(ranks)
        if node.dtype.kind in "iu" and bool((node.reshape(-1, n) == node[:n]).all()):
            nodes = sorted({int(x) for x in node[:n].tolist()})  # each rank on the same node in every step
        else:
            nodes = sorted(int(x) for x in st["node"].unique())
        return cls(grid, [int(r) for r in ranks.tolist()], nodes)


def build_report(data: RunData, findings: list[Finding], errors: list[str] | None = None,
                 coverage: list[Coverage] | None = None, with_plots: bool = True) -> DiagnoseReport:
    """The report of ``data`` with the checks' ``findings``, ``errors`` and ``coverage`` (``analyzers.run_all``'s;
    without ``coverage``, it is judged here: ``analyzers.check_coverage``). ``with_plots=False`` leaves the HTML
    page's plot series out (``plots`` holds only the event marks; the text and JSON reports draw no plot, and on a big
    run the series cost seconds)."""
    coverage = coverage if coverage is not None else check_coverage(data)
    not_run = [c.check for c in coverage if c.status in NOT_RUN]
    label, peak_sim = peak_label(data)
    ser = series(data)
    simulated = bool(any(f.simulated for f in findings) or data.simulated_gpu or peak_sim)
    w = worst_severity(findings)
    m = data.manifest
    hist = history(data)
    placement = Placement(data)  # its rank -> node map is a pass over the step records: build it once
    rows = StepRows.of(data.steps)  # the step records' grid, ranks and nodes, worked out once for the report
    plots = (plot_data(data, findings, hist, fault_events(data)) if with_plots else
             PlotData(events=events(findings, hist, fault_events(data))))  # the marks only: the summary lists them
    what_happened = history_line(hist)
    summary: Summary = {
        "run_id": data.run_id,
        "verdict": verdict(data, findings, coverage, nranks=len(rows.ranks)) + (f". {what_happened}" if what_happened else ""),
        "findings": [finding_dict(f) for f in findings],
        "coverage": [c.to_dict() for c in coverage],
        "checks_not_run": not_run,
        "faults": fault_rows(data, findings, placement.rank_node),
        "history": hist,
        "traces": grouped(trace_windows(data.trace_summaries.itertuples(index=False), placement.rank_node.get,
                                        windows=TRACE_WINDOWS)),
        "simulated": simulated,
        "worst_severity": w,
        "exit_code": EXIT_INCOMPLETE if EXIT[w] == EXIT_HEALTHY and not_run else EXIT[w],
        "steps": [int(data.steps["step"].min()), int(data.steps["step"].max())],
        "ranks": rows.ranks,
        "nodes": rows.nodes,
        "world_size": world_size(data),
        # the layout the run started with (a re-formed job's later world sizes are in history.attempts); without a
        # manifest, what the step records imply
        "layout": _first_layout(m) if m is not None else data.inferred_layout(),
        "peak": label,
        "mfu_median": _num(ser["mfu"].median()) if ser["mfu"].notna().any() else None,
        "step_ms_median": _num(ser["step_ms"].median()),
        "source": data.source,
        "truncated_lines": data.truncated_lines,
        "bad_lines": data.bad_lines,
        "damaged_parts": data.damaged_parts,
        "analyzer_errors": errors or [],
        "events": [dict(step=e.step, kind=e.kind, label=e.label) for e in plots.events],
    }
    signal = data.compute_signal()
    return DiagnoseReport(
        summary=summary, platform=f"{m.backend}/{m.device}" if m is not None else None,
        compute_label=data.device_time_label() if signal == "device_ms" else "compute time",
        cells_of=lambda: rank_step_matrix(data.steps, signal, grid=rows.grid), over_time=ser, plots=plots, rank_node=dict(placement.rank_node))


def _builtin(x: Any) -> Any:
    """numpy scalars and arrays in a finding's evidence (checks compute with numpy) as Python values."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise NotImplementedError(f"cannot encode {type(x).__name__}")


def finding_dict(f: Finding) -> dict[str, Any]:
    d = msgspec.to_builtins(f, enc_hook=_builtin)
    return {k: d.get(k) for k in FINDING_FIELDS}


def worst_severity(findings: list[Finding]) -> str | None:
    w = None
    for f in findings:
        if w is None or SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[w]:
            w = f.severity
    return w


def verdict(data: RunData, findings: list[Finding], coverage: list[Coverage] | None = None,
            nranks: int | None = None) -> str:
    """One sentence: HEALTHY when every check that applies ran and found nothing worse than info; INCOMPLETE when
    nothing was found but some checks could not run (a problem they look for would not have been seen); else the
    worst finding. Either way it says how many checks could not run. ``nranks``: the step records' distinct ranks,
    where the caller has them."""
    w = worst_severity(findings)
    nranks = data.steps["rank"].nunique() if nranks is None else nranks
    s0, s1 = int(data.steps["step"].min()), int(data.steps["step"].max())
    not_run = [c.check for c in coverage or [] if c.status in NOT_RUN]
    gap = (f"{len(not_run)} of {len(coverage or [])} checks could not run ({', '.join(not_run)})" if not_run else "")
    if w in (None, "info"):
        if not_run:
            return (f"INCOMPLETE: no problems found across {nranks} ranks, steps {s0}-{s1}, but {gap}: what they look "
                    f"for would not have been seen (see 'checks that could not run')")
        return f"HEALTHY: no problems found across {nranks} ranks, steps {s0}-{s1}"
    counts = {s: sum(f.severity == s for f in findings) for s in ("critical", "warning")}
    parts = [f"{n} {s}" for s, n in counts.items() if n]
    top = next(f for f in findings if f.severity == w)
    label = "CRITICAL" if w == "critical" else "WARNING"
    return f"{label} ({', '.join(parts)}): {top.summary}" + (f"; {gap}" if gap else "")


def world_size(data: RunData) -> int:
    """The run's world size: the manifest's layout (its first attempt's), else the step records' ``world_size``,
    else the ranks that wrote steps."""
    lay = _first_layout(data.manifest)
    if lay.get("world"):
        return int(lay["world"])
    if data.manifest is not None and data.manifest.ranks:
        return len(data.manifest.ranks)
    return int(data.inferred_layout().get("world") or data.steps["rank"].nunique())


def fault_rows(data: RunData, findings: list[Finding], rank_node: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Each injected fault of the manifest: whether a warning-or-worse finding of its kind names it, which one
    (the earliest confirmed), and how many steps after the fault's start. ``rank_node``: the placement's, where the
    caller has it."""
    if data.manifest is None:
        return []
    rank_node = Placement(data).rank_node if rank_node is None else rank_node
    rows = []
    for fault in data.manifest.faults:
        hits = [f for f in findings if SEVERITY_ORDER[f.severity] >= 1 and matches(f, fault, rank_node, primary_only=True)]
        best = min(hits, key=lambda f: detection_step(f) if detection_step(f) is not None else 10**9) if hits else None
        ds = detection_step(best) if best is not None else None
        rows.append(dict(fault=msgspec.to_builtins(fault), found=best is not None,
                         finding=best.summary if best is not None else None,
                         latency_steps=(ds - fault.start) if ds is not None else None))
    return rows


def fault_events(data: RunData) -> list[Event]:
    """Each injected fault of the manifest as a mark on the report's time axes, labelled as ground truth."""
    out = []
    for f in data.manifest.faults if data.manifest is not None else []:
        where = fault_target(msgspec.to_builtins(f))
        out.append(Event(int(f.start), "fault", f"fault injected (ground truth): {f.kind.replace('_', ' ')} on {where}"))
    return out


def history(data: RunData) -> dict[str, Any]:
    """What happened to the job while it ran: its (re)starts from the manifest, and the head's actions (checkpoint,
    profile, evict; by a person or the policy) with their current status."""
    attempts = [dict(a) for a in (data.manifest.attempts if data.manifest is not None else [])]
    actions = []
    if not data.actions.empty:
        for a in data.actions.to_dict(orient="records"):
            step = a.get("applied_step")
            actions.append(dict(id=a.get("id"), action=a.get("action"), node=_int(a.get("node")), status=a.get("status"),
                                applied_step=_int(step), dry_run=bool(a.get("dry_run")), requested_by=a.get("requested_by"),
                                finding_kind=a.get("finding_kind"), reason=a.get("reason"), t=_num(a.get("t"))))
    return {"attempts": attempts, "actions": actions}


def history_line(hist: dict[str, Any]) -> str:
    """One sentence for the verdict: evictions carried out and how the run went on."""
    evicts = [a for a in hist["actions"] if a["action"] == "evict" and a["status"] == "applied" and not a["dry_run"]]
    if not evicts:
        return ""
    parts = [f"node {a['node']} evicted at step {a['applied_step']} ({a['requested_by']})" for a in evicts]
    last = hist["attempts"][-1] if hist["attempts"] else {}
    tail = ""
    if last.get("resumed_step") is not None:
        tail = f", the run resumed from step {last['resumed_step']} on {last.get('world_size')} ranks"
        if last.get("ended_step") is not None:
            tail += f" and reached step {last['ended_step']}"
    return "; ".join(parts) + tail


def history_rows(hist: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(when, what, by, detail) for each restart and action, in step order (an action before the restart it caused):
    the rows of the report's history table, in every renderer that draws one."""
    rows = []
    for a in hist["attempts"]:
        what = f"attempt {a.get('attempt')}: {a.get('world_size')} ranks"
        if a.get("resumed_step") is not None:
            what += f", resumed from step {a['resumed_step']}"
        ended = f"ran to step {a['ended_step']}" if a.get("ended_step") is not None else ""
        if a.get("evicted_node") is not None:
            ended += f", then node {a['evicted_node']} left"
        start = a.get("resumed_step") or 0
        rows.append((start, 1, (f"step {start}", what, "torchrun", ended)))
    for a in hist["actions"]:
        when = f"step {a['applied_step']}" if a["applied_step"] is not None else "-"
        status = "dry run, not sent" if a["dry_run"] else a["status"]
        rows.append((a["applied_step"] if a["applied_step"] is not None else 10**9, 0,
                     (when, f"{a['action']} node {a['node'] if a['node'] is not None else '-'} ({status})",
                      str(a["requested_by"] or ""), a["reason"] or "")))
    return [cells for _, _, cells in sorted(rows, key=lambda r: (r[0], r[1]))]


def trace_title(w: dict[str, Any]) -> str:
    """The heading of one capture window's table, saying what its "kernel" time is."""
    if w["steps"] is None:
        span = "no ProfilerStep marks, totals"
    else:
        span = f"step {w['step_start']}" if w["steps"] == 1 else f"steps {w['step_start']}-{w['step_end']}"
    what = ("CPU trace: op time is host time, not device kernel time" if w["cpu"]
            else f"{w['device']}: device kernel time")
    return f"profiler trace ({w['kind']}), {span} ({what})"


def trace_rows(w: dict[str, Any], limit: int | None = None) -> list[tuple[str, ...]]:
    """The TRACE_COLUMNS cells of one capture window, one row per rank (per step; window totals without steps). With
    more ranks than ``limit``: the ``limit`` ranks with the most kernel time against the median, in rank order
    (``trace_rows_note`` says so)."""
    def ms(x):
        return "-" if x is None else f"{x:.2f}"

    per = "" if w["steps"] is None else "_per_step"
    ranks = w["ranks"]
    if limit is not None and len(ranks) > limit:
        keep = sorted(ranks, key=lambda r: -(r["kernel_vs_median"] if r["kernel_vs_median"] is not None else -1.0))
        ranks = sorted(keep[:limit], key=lambda r: r["rank"])
    return [(str(r["rank"]), "-" if r["node"] is None else str(r["node"]), ms(r["kernel_ms" + per]),
             "-" if r["kernel_vs_median"] is None else f"{r['kernel_vs_median']:.2f}x", ms(r["nccl_ms" + per]),
             ms(r["exposed_comm_ms" + per]), ms(r["copy_ms" + per]),
             "-" if r["idle_share"] is None else f"{100 * r['idle_share']:.1f}",
             r["trace_file"] + (" (cut short)" if r["truncated"] else "")) for r in ranks]


def trace_rows_note(w: dict[str, Any], limit: int) -> str:
    """What a capture window's table leaves out at ``limit`` rows ("" when every rank has its row)."""
    n = len(w["ranks"])
    return (f"{limit} of {n} ranks shown: those with the most kernel time against the median (every rank: --json)"
            if n > limit else "")


def layout_words(s: Summary) -> str:
    """The run's shape in words: "dp 2 × tp 2 × pp 1, 4 ranks on 2 nodes" (and the pipeline's schedule when pp > 1)."""
    lay = s["layout"] or {}
    dims = [f"{k} {lay[k]}" for k in ("dp", "tp", "pp") if lay.get(k) is not None]
    n_ranks, n_nodes = s["world_size"] or len(s["ranks"]), len(s["nodes"])
    shape = f"{n_ranks} rank{'s' if n_ranks != 1 else ''} on {n_nodes} node{'s' if n_nodes != 1 else ''}"
    out = (" × ".join(dims) + ", " if dims else "") + shape
    if int(lay.get("pp") or 1) > 1:
        out += f"; {lay.get('pp_schedule') or 'unknown'} schedule, {lay.get('microbatches') or '?'} micro-batches"
        if int(lay.get("virtual_stages") or 1) > 1:
            out += f", {lay['virtual_stages']} virtual stages"
    if lay.get("dp_mode"):
        out += f"; data parallel by {str(lay['dp_mode']).upper()}"
    if lay.get("precision"):
        out += f"; {lay['precision']}"
    return out


def fault_target(fault: dict[str, Any], rank_node: dict[int, int] | None = None) -> str:
    """Where an injected fault acts, in words: "rank 3 (node 1)", "node 1", or "every rank" (never "node None")."""
    if fault.get("rank") is not None:
        node = (rank_node or {}).get(int(fault["rank"]))
        return f"rank {fault['rank']}" + (f" (node {node})" if node is not None else "")
    if fault.get("node") is not None:
        return f"node {fault['node']}"
    return "every rank"


def fault_magnitude(fault: dict[str, Any]) -> str:
    """How strong an injected fault is, in words ("1.5x slower", "+50 ms", "XID 79"); "" when the spec says nothing."""
    if fault.get("factor") is not None:
        return f"{fault['factor']:g}x slower"
    if fault.get("delay_ms") is not None:
        return f"+{fault['delay_ms']:g} ms"
    if fault.get("rate_mbit") is not None:
        return f"limited to {fault['rate_mbit']:g} Mbit/s"
    if fault.get("code") is not None:
        return f"code {fault['code']}"
    return ""


def next_steps(s: Summary) -> list[str]:
    """What to do next: the warning-or-worse findings' recommendations, most severe first, each once; then what the
    checks that could not run need."""
    recs: list[str] = []
    ranked = sorted(s["findings"], key=lambda f: -SEVERITY_ORDER[f["severity"]])
    for f in ranked:
        r = (f["recommendation"] or "").strip()
        if f["severity"] != "info" and r and r not in recs:
            recs.append(r)
    if s["checks_not_run"]:
        recs.append(f"Give the checks that could not run ({', '.join(s['checks_not_run'])}) the fields they need "
                    "(see 'checks that could not run'), then diagnose the next run.")
    return recs


def _first_layout(m: Any) -> dict[str, Any]:
    if m is None:
        return {}
    lay = dict(m.layout)
    first = m.attempts[0] if m.attempts else None
    if first and first.get("world_size") and lay.get("world") and first["world_size"] != lay["world"]:
        # the manifest's layout is the newest attempt's: scale the data-parallel degree back to the first world size
        tp, pp = int(lay.get("tp") or 1), int(lay.get("pp") or 1)
        lay.update(world=int(first["world_size"]), dp=int(first["world_size"]) // (tp * pp))
    return lay


def _int(x: Any) -> int | None:
    v = _num(x)
    return None if v is None else int(v)


def _num(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, 6) if math.isfinite(x) else None
