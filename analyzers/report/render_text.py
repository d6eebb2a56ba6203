"""The diagnose report on a terminal (rich): header, verdict, findings, the checks that could not run, heat map,
sparklines, faults, history, what to do next. Everything fits the console's width (80 columns and up): text wraps
with its indent kept, tables drop their least useful columns (and say which) rather than cut a value."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ranksight.fit_table import Col, dropped_note, fit_table

from analyzers.report.model import (TRACE_COLUMNS, TRACE_ROWS, DiagnoseReport, history_rows, trace_rows, trace_rows_note,
                                    trace_title)
from analyzers.report.sentences import evidence_sentences, plain_items

SPARK = "▁▂▃▄▅▆▇█"
SEV_STYLE = {"critical": "bold white on red", "warning": "bold black on yellow", "info": "bold white on blue"}


def render_text(report: DiagnoseReport, console: Any) -> None:
    """Print the report on ``console`` (a rich Console)."""
    s = report.summary
    _header(report, console)
    _findings(s["findings"], console)
    _coverage(s["coverage"], console)
    _heat_map(report, console)
    _over_time(report, console)
    _faults(s["faults"], console)
    _history(s["history"], console)
    _traces(s["traces"], console)
    _next_steps(s, console)


def _header(report: DiagnoseReport, console: Any) -> None:
    s = report.summary
    lay = s["layout"]
    lay_txt = " ".join(f"{k}={lay[k]}" for k in ("dp", "tp", "pp", "microbatches", "pp_schedule") if k in lay)
    hdr = Text()
    hdr.append(f"run {s['run_id']}", style="bold")
    hdr.append(f"  ranks {len(s['ranks'])} on {len(s['nodes'])} node(s)  steps {s['steps'][0]}-{s['steps'][1]}")
    if lay_txt:
        hdr.append(f"  {lay_txt}")
    if report.platform is not None:
        hdr.append(f"  {report.platform}")
    hdr.append(f"  source: {s['source']}")
    if s["truncated_lines"] or s["bad_lines"]:
        hdr.append(f"  ({s['truncated_lines']} truncated / {s['bad_lines']} bad line(s) skipped)", style="yellow")
    if s.get("damaged_parts"):
        hdr.append(f"  ({s['damaged_parts']} damaged store part file(s) skipped: their rows are missing)", style="bold red")
    console.print(hdr)
    style = {"critical": "bold red", "warning": "bold yellow"}.get(
        s["worst_severity"], "bold yellow" if s["checks_not_run"] else "bold green")
    console.print(Panel(Text(s["verdict"], style=style), title="verdict", expand=True))


def _findings(fs: list[dict[str, Any]], console: Any) -> None:
    if not fs:
        console.print(Text("No findings.", style="green"))
        return
    console.print(Text("Findings", style="bold underline"))
    for f in fs:
        line = Text(f"[{f['kind']}] ", style="bold")
        line.append(f["summary"], style="")
        if f["simulated"]:
            line.append(" (simulated)", style="magenta")
        head = Table.grid(padding=(0, 1))  # the summary wraps beside the severity badge, not under it
        head.add_column(no_wrap=True)
        head.add_column(overflow="fold")
        head.add_row(Text(f" {f['severity'].upper():8} ", style=SEV_STYLE[f["severity"]]), line)
        console.print(head)
        where = (f"    ranks {','.join(map(str, f['ranks'])) or '-'}  nodes {','.join(map(str, f['nodes'])) or '-'}"
                 f"  steps {f['step_start'] if f['step_start'] is not None else '?'}-"
                 f"{f['step_end'] if f['step_end'] is not None else '?'}  confidence {f['confidence']:.2f}")
        console.print(_indented(Text(where.strip(), style="dim")))
        # the evidence as the HTML page says it: sentences with the numbers, then what they do not mention, plainly
        sentences, rest = evidence_sentences(f)
        for sentence in sentences:
            console.print(_indented(Text(sentence, style="cyan")))
        if rest:
            measured = "; ".join(f"{k} {v}" for k, v in plain_items(rest))
            console.print(_indented(Text(f"measured: {measured}", style="dim cyan")))
        console.print(_indented(Text(f"-> {f['recommendation']}", style="green")))


def _indented(text: Text, indent: int = 4) -> Padding:
    """``text`` indented, its wrapped lines too (a word longer than the line folds rather than being cut)."""
    text.overflow = "fold"
    return Padding(text, (0, 0, 0, indent))


def _coverage(cov: list[dict[str, Any]], console: Any) -> None:
    """The checks that could not judge the run, and why; then those that ran with limits."""
    not_run = [c for c in cov if c["status"] in ("not_run", "error")]
    limited = [c for c in cov if c["status"] == "limited"]
    if not_run:
        console.print(Text(f"Checks that could not run ({len(not_run)} of {len(cov)})", style="bold underline"))
        for c in not_run:
            line = Text(f"{c['check']}: could not run: ", style="bold yellow")
            line.append(c["reason"], style="yellow")
            console.print(_indented(line, 2))
    if limited:
        console.print(Text("Checks that ran with limits", style="dim underline"))
        for c in limited:
            console.print(_indented(Text(f"{c['check']}: {c['reason']}", style="dim"), 2))


def _heat_map(report: DiagnoseReport, console: Any) -> None:
    hv = report.heat_view(max(8, min(48, console.width - 32)), max_rows=32)
    heat, spans, med = hv.rows, hv.spans, hv.median
    if heat.empty:
        return
    t = Table(title=f"{report.compute_label} per rank x step (colour: vs the step's median rank)", show_header=True,
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
        label = hv.labels[r].removeprefix("rank ")
        t.add_row(label, cells, f"{float(np.nanmedian(heat.loc[r])):.1f}")
    console.print(t)
    if hv.others:
        console.print(Text(f"  {len(heat) - 3} ranks shown (named by findings, then most out of line); the others' rows: "
                           f"p95, median and p5 of the other {hv.others} ranks per column", style="dim"))
    console.print(Text("  legend: ", style="dim") + Text("█<1.05x ", style="green") + Text("█<1.15x ", style="yellow")
                  + Text("█<1.5x ", style="dark_orange") + Text("█>=1.5x", style="red"))


def _over_time(report: DiagnoseReport, console: Any) -> None:
    ser = report.over_time
    if ser.empty:
        return
    if ser["mfu"].notna().any():
        mf = ser["mfu"]
        console.print(Text(f"MFU        {sparkline(list(mf))}  {np.nanmin(mf):.1%}..{np.nanmax(mf):.1%} "
                           f"(median {np.nanmedian(mf):.1%})"))
    elif (ser["tflops"] > 0).any():
        tf = ser["tflops"]
        console.print(Text(f"TFLOP/s    {sparkline(list(tf))}  {np.nanmin(tf):.3g}..{np.nanmax(tf):.3g}"))
    else:
        console.print(Text("MFU        n/a: no flops in the step records", style="dim"))
    sm = ser["step_ms"]
    console.print(Text(f"step ms    {sparkline(list(sm))}  {np.nanmin(sm):.0f}..{np.nanmax(sm):.0f} (median {np.nanmedian(sm):.0f})"))
    console.print(Text(f"peak: {report.summary['peak']}", style="dim"))


def _fitted(console: Any, title: str, cols: list[Col], rows: list[list[Any]], drop: tuple[str, ...]) -> None:
    """A table that fits the console (``ranksight.fit_table``: columns in ``drop`` left out first, values folded,
    never cut), and the line naming what was left out."""
    console.print(Text(title, style="italic"))  # above, not as the table's title: that wraps at the table's width
    fitted = fit_table(console, cols, rows, drop)
    console.print(fitted.table)
    if fitted.dropped:
        console.print(Text(dropped_note(fitted.dropped, console.width), style="dim"))


def _faults(faults: list[dict[str, Any]], console: Any) -> None:
    if not faults:
        return
    rows = []
    for row in faults:
        fl = row["fault"]
        target = f"rank {fl['rank']}" if fl.get("rank") is not None else (f"node {fl['node']}" if fl.get("node") is not None else "world")
        mag = next((f"{k}={fl[k]}" for k in ("factor", "delay_ms", "code") if fl.get(k) is not None), "")
        steps = f"{fl.get('start', 0)}-{fl['end'] if fl.get('end') is not None else 'end'}"
        found = (Text(f"yes, {row['latency_steps']} step(s) after onset: {row['finding']}", style="green") if row["found"]
                 else Text("MISSED", style="bold red"))
        rows.append([f"{fl['kind']} {mag}".strip(), target, steps, found])
    _fitted(console, "injected faults (ground truth) vs findings",
            [Col("fault"), Col("target"), Col("steps"), Col("found?")], rows, ())


def _history(hist: dict[str, Any], console: Any) -> None:
    if not (len(hist["attempts"]) > 1 or hist["actions"]):
        return
    rows = [[when, what, by, detail if len(detail) <= 120 else detail[:117] + "..."]
            for when, what, by, detail in history_rows(hist)]
    _fitted(console, "what happened to the job (restarts, and the head's actions)",
            [Col("when"), Col("what"), Col("by"), Col("detail")], rows, ("by",))


def _traces(windows: list[dict[str, Any]], console: Any) -> None:
    cols = [Col(c, "left" if c == "trace" else "right") for c in TRACE_COLUMNS]
    for w in windows:
        _fitted(console, trace_title(w), cols, [list(r) for r in trace_rows(w, TRACE_ROWS)],
                ("trace", "memcpy/set ms/step", "idle %", "node"))
        note = trace_rows_note(w, TRACE_ROWS)
        if note:
            console.print(Text(note, style="dim"))


def _next_steps(s: dict[str, Any], console: Any) -> None:
    recs = []
    for f in s["findings"]:
        if f["severity"] != "info" and f["recommendation"] not in recs:
            recs.append(f["recommendation"])
    console.print(Text("What to do next", style="bold underline"))
    if s["checks_not_run"]:
        recs.append(f"Give the checks that could not run ({', '.join(s['checks_not_run'])}) the fields they need "
                    "(see 'checks that could not run'), then diagnose the next run.")
    if recs:
        steps = Table.grid(padding=(0, 1))
        steps.add_column(justify="right")
        steps.add_column(overflow="fold")
        for i, r in enumerate(recs[:6], 1):
            steps.add_row(f"  {i}.", Text(r))
        console.print(steps)
    else:
        console.print(_indented(Text("Nothing to fix. Keep the run's report as a baseline for the next one."), 2))
    if s["simulated"]:
        console.print(Text("Note: parts of this report rest on SIMULATED telemetry (GPU samples from the simulator) or a peak "
                           "measured on a CPU; they are marked (simulated).", style="magenta"))
    for e in s["analyzer_errors"]:
        console.print(Text(f"analyzer error: {e.splitlines()[0]}", style="red"))


def sparkline(values: list[float], width: int = 60) -> str:
    """Values as a line of block characters (at most ``width``: medians of equal runs of values)."""
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
