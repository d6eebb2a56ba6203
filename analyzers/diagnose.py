"""``diagnose <run-id>``: the post-mortem report of a run.

Reads the run store (or, without agents, the spool files), runs every analyzer, and prints a
report a person reads in a minute: a verdict, findings by severity with their evidence, a
rank x step heat map of compute time, MFU and step time over time, the injected faults next to
what was found, and what to do next. ``--json`` prints one object; ``--html FILE`` writes a
self-contained page with inline SVG plots.

Exit codes: 0 nothing worse than info, 1 warnings, 2 critical, 3 the run could not be read.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import msgspec
import numpy as np
import pandas as pd
import typer

from analyzers import run_all
from analyzers.builder import Placement
from analyzers.loader import LoadError, RunData, load_run
from ranksight.layout import DEFAULT_STORE
from ranksight.schema import SEVERITY_ORDER, Finding

FINDING_FIELDS = ("analyzer", "kind", "severity", "ranks", "nodes", "step_start", "step_end", "evidence",
                  "recommendation", "confidence", "summary", "simulated")
EXIT = {None: 0, "info": 0, "warning": 1, "critical": 2}
EXIT_LOAD_ERROR = 3
SPARK = "▁▂▃▄▅▆▇█"
SEV_STYLE = {"critical": "bold white on red", "warning": "bold black on yellow", "info": "bold white on blue"}


# --------------------------------------------------------------------------
# The report as data (shared by console, JSON and HTML)
# --------------------------------------------------------------------------


def finding_dict(f: Finding) -> dict[str, Any]:
    d = msgspec.to_builtins(f)
    return {k: d.get(k) for k in FINDING_FIELDS}


def worst(findings: list[Finding]) -> str | None:
    w = None
    for f in findings:
        if w is None or SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[w]:
            w = f.severity
    return w


def verdict(data: RunData, findings: list[Finding]) -> str:
    w = worst(findings)
    nranks = data.steps["rank"].nunique()
    s0, s1 = int(data.steps["step"].min()), int(data.steps["step"].max())
    if w in (None, "info"):
        return f"HEALTHY: no problems found across {nranks} ranks, steps {s0}-{s1}"
    counts = {s: sum(f.severity == s for f in findings) for s in ("critical", "warning")}
    parts = [f"{n} {s}" for s, n in counts.items() if n]
    top = next(f for f in findings if f.severity == w)
    label = "CRITICAL" if w == "critical" else "WARNING"
    return f"{label} ({', '.join(parts)}): {top.summary}"


def fault_rows(data: RunData, findings: list[Finding]) -> list[dict[str, Any]]:
    from analyzers.score import detection_step, matches

    if data.manifest is None:
        return []
    rank_node = Placement(data).rank_node
    rows = []
    for fault in data.manifest.faults:
        hits = [f for f in findings if SEVERITY_ORDER[f.severity] >= 1 and matches(f, fault, rank_node, primary_only=True)]
        best = min(hits, key=lambda f: detection_step(f) if detection_step(f) is not None else 10**9) if hits else None
        ds = detection_step(best) if best is not None else None
        rows.append(dict(fault=msgspec.to_builtins(fault), found=best is not None,
                         finding=best.summary if best is not None else None,
                         latency_steps=(ds - fault.start) if ds is not None else None))
    return rows


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
    the rows of the report's history table, on the console and in the HTML."""
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


def _int(x: Any) -> int | None:
    v = _num(x)
    return None if v is None else int(v)


def build_report(data: RunData, findings: list[Finding], errors: list[str] | None = None) -> dict[str, Any]:
    from analyzers.checks.mfu import peak_label, series

    label, peak_sim = peak_label(data)
    ser = series(data)
    simulated = bool(any(f.simulated for f in findings) or data.simulated_gpu or peak_sim)
    w = worst(findings)
    m = data.manifest
    hist = history(data)
    what_happened = history_line(hist)
    return {
        "run_id": data.run_id,
        "verdict": verdict(data, findings) + (f". {what_happened}" if what_happened else ""),
        "findings": [finding_dict(f) for f in findings],
        "faults": fault_rows(data, findings),
        "history": hist,
        "simulated": simulated,
        "worst_severity": w,
        "exit_code": EXIT[w],
        "steps": [int(data.steps["step"].min()), int(data.steps["step"].max())],
        "ranks": sorted(int(r) for r in data.steps["rank"].unique()),
        "nodes": sorted(int(n) for n in data.steps["node"].unique()),
        # the layout the run started with (a re-formed job's later world sizes are in history.attempts)
        "layout": _first_layout(m),
        "peak": label,
        "mfu_median": _num(ser["mfu"].median()) if ser["mfu"].notna().any() else None,
        "step_ms_median": _num(ser["step_ms"].median()),
        "source": data.source,
        "truncated_lines": data.truncated_lines,
        "bad_lines": data.bad_lines,
        "analyzer_errors": errors or [],
    }


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


def _num(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, 6) if math.isfinite(x) else None


# --------------------------------------------------------------------------
# Heat map and sparklines
# --------------------------------------------------------------------------


def heat_matrix(data: RunData, max_cols: int = 48) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
    """Rank x step-bucket matrix of each rank's median compute signal (device time when recorded, else the
    wall-clock compute_ms; see RunData.compute_signal), and each bucket's (first, last) step."""
    st = data.steps
    piv = st.pivot_table(index="rank", columns="step", values=data.compute_signal(), aggfunc="last").sort_index(axis=1)
    steps = list(piv.columns)
    if not steps:
        return piv, []
    size = max(1, math.ceil(len(steps) / max_cols))
    buckets = [steps[i:i + size] for i in range(0, len(steps), size)]
    cols = {}
    spans = []
    for b in buckets:
        cols[b[0]] = piv[b].median(axis=1)
        spans.append((int(b[0]), int(b[-1])))
    return pd.DataFrame(cols), spans


def sparkline(values: list[float], width: int = 60) -> str:
    vals = [v for v in values]
    if not vals:
        return ""
    if len(vals) > width:
        size = math.ceil(len(vals) / width)
        vals = [float(np.nanmedian(vals[i:i + size])) for i in range(0, len(vals), size)]
    finite = [v for v in vals if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    out = []
    for v in vals:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif hi - lo < 1e-12:
            out.append(SPARK[3])
        else:
            out.append(SPARK[min(7, int((v - lo) / (hi - lo) * 7.999))])
    return "".join(out)


def _heat_style(ratio: float) -> str:
    if not math.isfinite(ratio):
        return "grey23"
    if ratio < 1.05:
        return "green"
    if ratio < 1.15:
        return "yellow"
    if ratio < 1.5:
        return "dark_orange"
    return "red"


# --------------------------------------------------------------------------
# Console
# --------------------------------------------------------------------------


def render_console(report: dict[str, Any], data: RunData, console: Any) -> None:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    m = data.manifest
    lay = report["layout"]
    lay_txt = " ".join(f"{k}={lay[k]}" for k in ("dp", "tp", "pp", "microbatches", "pp_schedule") if k in lay)
    hdr = Text()
    hdr.append(f"run {report['run_id']}", style="bold")
    hdr.append(f"  ranks {len(report['ranks'])} on {len(report['nodes'])} node(s)  steps {report['steps'][0]}-{report['steps'][1]}")
    if lay_txt:
        hdr.append(f"  {lay_txt}")
    if m is not None:
        hdr.append(f"  {m.backend}/{m.device}")
    hdr.append(f"  source: {report['source']}")
    if report["truncated_lines"] or report["bad_lines"]:
        hdr.append(f"  ({report['truncated_lines']} truncated / {report['bad_lines']} bad line(s) skipped)", style="yellow")
    console.print(hdr)
    w = report["worst_severity"]
    style = {"critical": "bold red", "warning": "bold yellow"}.get(w, "bold green")
    console.print(Panel(Text(report["verdict"], style=style), title="verdict", expand=True))

    fs = report["findings"]
    if fs:
        console.print(Text("Findings", style="bold underline"))
        for f in fs:
            line = Text()
            line.append(f" {f['severity'].upper():8} ", style=SEV_STYLE[f["severity"]])
            line.append(f" [{f['kind']}] ", style="bold")
            line.append(f["summary"])
            if f["simulated"]:
                line.append(" (simulated)", style="magenta")
            console.print(line)
            where = (f"    ranks {','.join(map(str, f['ranks'])) or '-'}  nodes {','.join(map(str, f['nodes'])) or '-'}"
                     f"  steps {f['step_start'] if f['step_start'] is not None else '?'}-"
                     f"{f['step_end'] if f['step_end'] is not None else '?'}  confidence {f['confidence']:.2f}")
            console.print(Text(where, style="dim"))
            ev = ", ".join(f"{k}={_short(v)}" for k, v in f["evidence"].items())
            console.print(Text(f"    evidence: {ev}", style="cyan"), overflow="fold")
            console.print(Text(f"    -> {f['recommendation']}", style="green"))
    else:
        console.print(Text("No findings.", style="green"))

    # heat map
    heat, spans = heat_matrix(data)
    if not heat.empty:
        med = heat.median(axis=0)
        signal = data.compute_signal()
        what = data.device_time_label() if signal == "device_ms" else "compute time"
        t = Table(title=f"{what} per rank x step (colour: vs the step's median rank)", show_header=True,
                  header_style="dim", box=None, pad_edge=False, padding=(0, 1))
        t.add_column("rank", justify="right")
        size = spans[0][1] - spans[0][0] + 1 if spans else 1
        t.add_column(f"steps {spans[0][0]}..{spans[-1][1]}" + (f" ({size} steps per cell)" if size > 1 else ""), no_wrap=True)
        t.add_column("median ms", justify="right")
        for r in heat.index:
            cells = Text()
            for c in heat.columns:
                v = heat.loc[r, c]
                ratio = v / med[c] if med[c] and math.isfinite(v) else float("nan")
                cells.append("█", style=_heat_style(ratio))
            t.add_row(str(r), cells, f"{float(np.nanmedian(heat.loc[r])):.1f}")
        console.print(t)
        console.print(Text("  legend: ", style="dim") + Text("█<1.05x ", style="green") + Text("█<1.15x ", style="yellow")
                      + Text("█<1.5x ", style="dark_orange") + Text("█>=1.5x", style="red"))

    from analyzers.checks.mfu import series

    ser = series(data)
    if not ser.empty:
        if ser["mfu"].notna().any():
            mf = ser["mfu"]
            console.print(Text(f"MFU        {sparkline(list(mf))}  {np.nanmin(mf):.1%}..{np.nanmax(mf):.1%} "
                               f"(median {np.nanmedian(mf):.1%})"))
        else:
            tf = ser["tflops"]
            console.print(Text(f"TFLOP/s    {sparkline(list(tf))}  {np.nanmin(tf):.3g}..{np.nanmax(tf):.3g}"))
        sm = ser["step_ms"]
        console.print(Text(f"step ms    {sparkline(list(sm))}  {np.nanmin(sm):.0f}..{np.nanmax(sm):.0f} (median {np.nanmedian(sm):.0f})"))
        console.print(Text(f"peak: {report['peak']}", style="dim"))

    if report["faults"]:
        t = Table(title="injected faults (ground truth) vs findings", show_lines=False)
        t.add_column("fault")
        t.add_column("target")
        t.add_column("steps")
        t.add_column("found?")
        for row in report["faults"]:
            fl = row["fault"]
            target = f"rank {fl['rank']}" if fl.get("rank") is not None else (f"node {fl['node']}" if fl.get("node") is not None else "world")
            mag = next((f"{k}={fl[k]}" for k in ("factor", "delay_ms", "code") if fl.get(k) is not None), "")
            steps = f"{fl.get('start', 0)}-{fl['end'] if fl.get('end') is not None else 'end'}"
            found = (Text(f"yes, {row['latency_steps']} step(s) after onset: {row['finding']}", style="green") if row["found"]
                     else Text("MISSED", style="bold red"))
            t.add_row(f"{fl['kind']} {mag}", target, steps, found)
        console.print(t)

    hist = report["history"]
    if len(hist["attempts"]) > 1 or hist["actions"]:
        t = Table(title="what happened to the job (restarts, and the head's actions)", show_lines=False)
        for col in ("when", "what", "by", "detail"):
            t.add_column(col)
        for when, what, by, detail in history_rows(hist):
            t.add_row(when, what, by, detail if len(detail) <= 120 else detail[:117] + "...")
        console.print(t)

    recs = []
    for f in fs:
        if f["severity"] != "info" and f["recommendation"] not in recs:
            recs.append(f["recommendation"])
    console.print(Text("What to do next", style="bold underline"))
    if recs:
        for i, r in enumerate(recs[:5], 1):
            console.print(f"  {i}. {r}")
    else:
        console.print("  Nothing to fix. Keep the run's report as a baseline for the next one.")
    if report["simulated"]:
        console.print(Text("Note: parts of this report rest on SIMULATED telemetry (GPU samples from the simulator) or a peak "
                           "measured on a CPU; they are marked (simulated).", style="magenta"))
    for e in report["analyzer_errors"]:
        console.print(Text(f"analyzer error: {e.splitlines()[0]}", style="red"))


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
    return s if len(s) <= 80 else s[:77] + "..."


# --------------------------------------------------------------------------
# HTML (self-contained: inline CSS and SVG, no external assets)
# --------------------------------------------------------------------------

HEAT_COLORS = [(1.05, "#2e7d32"), (1.15, "#f9a825"), (1.5, "#ef6c00"), (float("inf"), "#c62828")]


def _svg_line(values: list[float], xs: list[int], title: str, fmt: str, width: int = 720, height: int = 140) -> str:
    pts = [(x, v) for x, v in zip(xs, values) if v is not None and math.isfinite(v)]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if hi - lo < 1e-12:
        hi = lo + 1
    pad = 30

    def sx(x: float) -> float:
        return pad + (x - x0) / max(x1 - x0, 1) * (width - 2 * pad)

    def sy(v: float) -> float:
        return height - pad + (lo - v) / (hi - lo) * (height - 2 * pad)

    path = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in pts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">'
            f'<text x="{pad}" y="16" font-size="12">{html.escape(title)}</text>'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#999"/>'
            f'<polyline fill="none" stroke="#1565c0" stroke-width="1.5" points="{path}"/>'
            f'<text x="2" y="{sy(hi) + 4:.0f}" font-size="10">{fmt.format(hi)}</text>'
            f'<text x="2" y="{sy(lo) + 4:.0f}" font-size="10">{fmt.format(lo)}</text>'
            f'<text x="{pad}" y="{height - 8}" font-size="10">step {x0}</text>'
            f'<text x="{width - pad - 50}" y="{height - 8}" font-size="10">step {x1}</text></svg>')


def _svg_heat(data: RunData) -> str:
    heat, spans = heat_matrix(data, max_cols=120)
    if heat.empty:
        return ""
    med = heat.median(axis=0)
    cw, ch, left, top = 6, 14, 50, 20
    w = left + cw * len(heat.columns) + 10
    h = top + ch * len(heat.index) + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" aria-label="compute heat map">',
             f'<text x="{left}" y="14" font-size="11">steps {spans[0][0]}..{spans[-1][1]}</text>']
    for i, r in enumerate(heat.index):
        parts.append(f'<text x="2" y="{top + i * ch + 11}" font-size="10">rank {r}</text>')
        for j, c in enumerate(heat.columns):
            v = heat.loc[r, c]
            ratio = v / med[c] if med[c] and math.isfinite(v) else float("nan")
            color = "#ddd" if not math.isfinite(ratio) else next(col for lim, col in HEAT_COLORS if ratio < lim)
            a, b = spans[j]
            parts.append(f'<rect x="{left + j * cw}" y="{top + i * ch}" width="{cw}" height="{ch - 1}" fill="{color}">'
                         f'<title>rank {r} steps {a}-{b}: {v:.1f} ms ({ratio:.2f}x median)</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(report: dict[str, Any], data: RunData) -> str:
    from analyzers.checks.mfu import series

    e = html.escape
    ser = series(data)
    xs = [int(x) for x in ser.index]
    plots = ""
    if ser["mfu"].notna().any():
        plots += _svg_line([float(v) * 100 for v in ser["mfu"]], xs, "MFU (%) per step", "{:.1f}")
    else:
        plots += _svg_line([float(v) for v in ser["tflops"]], xs, "TFLOP/s per rank per step", "{:.3g}")
    plots += _svg_line([float(v) for v in ser["step_ms"]], xs, "step time (ms)", "{:.0f}")
    sev_color = {"critical": "#c62828", "warning": "#f9a825", "info": "#1565c0"}
    items = []
    for f in report["findings"]:
        ev = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_short(v))}</td></tr>" for k, v in f["evidence"].items())
        items.append(
            f'<div class="f"><span class="sev" style="background:{sev_color[f["severity"]]}">{e(f["severity"])}</span> '
            f'<b>[{e(f["kind"])}]</b> {e(f["summary"])}{" <i>(simulated)</i>" if f["simulated"] else ""}'
            f'<div class="meta">ranks {e(",".join(map(str, f["ranks"])) or "-")} · nodes {e(",".join(map(str, f["nodes"])) or "-")} · '
            f'steps {f["step_start"]}-{f["step_end"]} · confidence {f["confidence"]:.2f}</div>'
            f'<table class="ev">{ev}</table><div class="rec">&rarr; {e(f["recommendation"])}</div></div>')
    faults = ""
    if report["faults"]:
        rows = "".join(
            f'<tr><td>{e(r["fault"]["kind"])}</td><td>{e(str(r["fault"].get("rank")))}</td><td>{e(str(r["fault"].get("node")))}</td>'
            f'<td>{r["fault"].get("start")}-{r["fault"].get("end") if r["fault"].get("end") is not None else "end"}</td>'
            f'<td>{"found" if r["found"] else "<b>MISSED</b>"}</td><td>{e(str(r["latency_steps"]))}</td><td>{e(r["finding"] or "")}</td></tr>'
            for r in report["faults"])
        faults = ("<h2>Injected faults vs findings</h2><table class='t'><tr><th>fault</th><th>rank</th><th>node</th><th>steps</th>"
                  f"<th>result</th><th>latency (steps)</th><th>finding</th></tr>{rows}</table>")
    hist, hist_html = report["history"], ""
    if len(hist["attempts"]) > 1 or hist["actions"]:
        rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>" for cells in history_rows(hist))
        hist_html = ("<h2>What happened to the job</h2><table class='t'><tr><th>when</th><th>what</th><th>by</th>"
                     f"<th>detail</th></tr>{rows}</table>")
    sim = ('<p class="sim">Parts of this report rest on SIMULATED telemetry or a CPU-measured peak; they are marked (simulated).</p>'
           if report["simulated"] else "")
    color = sev_color.get(report["worst_severity"] or "", "#2e7d32")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ranksight diagnose {e(report['run_id'])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}}
.verdict{{padding:.8em;border-left:8px solid {color};background:#f5f5f5;font-weight:bold}}
.f{{margin:1em 0;padding:.5em;border:1px solid #ddd}} .sev{{color:#fff;padding:0 .4em;border-radius:3px}}
.meta{{color:#666;font-size:90%}} .rec{{color:#2e7d32}} table.ev td{{font-size:85%;padding:0 .6em 0 0;font-family:monospace}}
table.t{{border-collapse:collapse}} table.t td,table.t th{{border:1px solid #ccc;padding:.2em .5em}} .sim{{color:#8e24aa}}
</style></head><body>
<h1>ranksight diagnose: {e(report['run_id'])}</h1>
<p>ranks {len(report['ranks'])} on {len(report['nodes'])} node(s), steps {report['steps'][0]}-{report['steps'][1]},
layout {e(json.dumps(report['layout']))}, source {e(report['source'])}; peak: {e(report['peak'])}</p>
<div class="verdict">{e(report['verdict'])}</div>
<h2>Findings</h2>{''.join(items) or '<p>No findings.</p>'}
<h2>Compute time per rank and step</h2><p>colour: the rank's compute time against the median rank of that step
(green &lt;1.05x, amber &lt;1.15x, orange &lt;1.5x, red above)</p>{_svg_heat(data)}
<h2>Over time</h2>{plots}
{faults}
{hist_html}
{sim}
</body></html>
"""


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def diagnose(run_id: str, store: str | os.PathLike | None = None, as_json: bool = False, html_file: str | None = None,
             since: int | None = None, until: int | None = None, progress: bool | None = None,
             out: Any = None) -> int:
    """Run the report; returns the exit code. ``out``: a rich Console (default: stdout)."""
    from rich.console import Console

    console = out or Console()
    err = Console(stderr=True)
    store = store if store is not None else os.environ.get("RANKSIGHT_STORE", str(DEFAULT_STORE))
    try:
        data = load_run(store, run_id, since=since, until=until, progress=False if as_json else progress)
    except LoadError as e:
        if as_json:
            print(json.dumps({"run_id": run_id, "error": str(e), "exit_code": EXIT_LOAD_ERROR}))
        else:
            err.print(f"[bold red]diagnose: cannot read run[/] {e}")
        return EXIT_LOAD_ERROR
    errors: list[str] = []
    findings = run_all(data, errors=errors)
    report = build_report(data, findings, errors)
    if html_file:
        Path(html_file).write_text(render_html(report, data), encoding="utf-8")
    if as_json:
        sys.stdout.write(json.dumps(report, default=str) + "\n")
        sys.stdout.flush()
    else:
        render_console(report, data, console)
        if html_file:
            console.print(f"[dim]HTML report written to {html_file}[/]")
    return report["exit_code"]


diagnose_command = typer.Typer(add_completion=False, help="Post-mortem report of a run.")


@diagnose_command.command(help="Post-mortem report of a run: which rank, which node, since which step, and why. "
                               "Exit 0 healthy, 1 warnings, 2 critical, 3 the run could not be read.")
def _diagnose_cli(
    run_id: str = typer.Argument(..., help="The run id (a directory under the store)."),
    store: Optional[str] = typer.Option(None, "--store", help="Run store directory (default $RANKSIGHT_STORE or ./runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    html_file: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML page to FILE."),
    since: Optional[int] = typer.Option(None, "--since", help="First step to analyse."),
    until: Optional[int] = typer.Option(None, "--until", help="Last step to analyse."),
) -> None:
    code = diagnose(run_id, store=store, as_json=as_json, html_file=html_file, since=since, until=until)
    raise typer.Exit(code)


def main() -> None:
    diagnose_command()


if __name__ == "__main__":
    main()
