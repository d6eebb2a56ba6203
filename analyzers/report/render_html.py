"""The diagnose report as one self-contained HTML page: inline CSS and SVG plots, no external assets."""

from __future__ import annotations

import html
import json
import math

from analyzers.evidence import short_value
from analyzers.report.model import TRACE_COLUMNS, DiagnoseReport, history_rows, trace_rows, trace_title

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


def _svg_heat(report: DiagnoseReport) -> str:
    heat, spans = report.heat_map(120)
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


def render_html(report: DiagnoseReport) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG plots, no external assets)."""
    e = html.escape
    ser = report.over_time
    s = report.summary
    xs = [int(x) for x in ser.index]
    plots = ""
    if ser["mfu"].notna().any():
        plots += _svg_line([float(v) * 100 for v in ser["mfu"]], xs, "MFU (%) per step", "{:.1f}")
    else:
        plots += _svg_line([float(v) for v in ser["tflops"]], xs, "TFLOP/s per rank per step", "{:.3g}")
    plots += _svg_line([float(v) for v in ser["step_ms"]], xs, "step time (ms)", "{:.0f}")
    sev_color = {"critical": "#c62828", "warning": "#f9a825", "info": "#1565c0"}
    items = []
    for f in s["findings"]:
        ev = "".join(f"<tr><td>{e(str(k))}</td><td>{e(short_value(v))}</td></tr>" for k, v in f["evidence"].items())
        items.append(
            f'<div class="f"><span class="sev" style="background:{sev_color[f["severity"]]}">{e(f["severity"])}</span> '
            f'<b>[{e(f["kind"])}]</b> {e(f["summary"])}{" <i>(simulated)</i>" if f["simulated"] else ""}'
            f'<div class="meta">ranks {e(",".join(map(str, f["ranks"])) or "-")} · nodes {e(",".join(map(str, f["nodes"])) or "-")} · '
            f'steps {f["step_start"]}-{f["step_end"]} · confidence {f["confidence"]:.2f}</div>'
            f'<table class="ev">{ev}</table><div class="rec">&rarr; {e(f["recommendation"])}</div></div>')
    faults = ""
    if s["faults"]:
        rows = "".join(
            f'<tr><td>{e(r["fault"]["kind"])}</td><td>{e(str(r["fault"].get("rank")))}</td><td>{e(str(r["fault"].get("node")))}</td>'
            f'<td>{r["fault"].get("start")}-{r["fault"].get("end") if r["fault"].get("end") is not None else "end"}</td>'
            f'<td>{"found" if r["found"] else "<b>MISSED</b>"}</td><td>{e(str(r["latency_steps"]))}</td><td>{e(r["finding"] or "")}</td></tr>'
            for r in s["faults"])
        faults = ("<h2>Injected faults vs findings</h2><table class='t'><tr><th>fault</th><th>rank</th><th>node</th><th>steps</th>"
                  f"<th>result</th><th>latency (steps)</th><th>finding</th></tr>{rows}</table>")
    hist, hist_html = s["history"], ""
    if len(hist["attempts"]) > 1 or hist["actions"]:
        rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>" for cells in history_rows(hist))
        hist_html = ("<h2>What happened to the job</h2><table class='t'><tr><th>when</th><th>what</th><th>by</th>"
                     f"<th>detail</th></tr>{rows}</table>")
    traces = "".join(
        f"<h2>{e(trace_title(w))}</h2><table class='t'><tr>{''.join(f'<th>{e(c)}</th>' for c in TRACE_COLUMNS)}</tr>"
        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>" for cells in trace_rows(w)) + "</table>"
        for w in s["traces"])
    sim = ('<p class="sim">Parts of this report rest on SIMULATED telemetry or a CPU-measured peak; they are marked (simulated).</p>'
           if s["simulated"] else "")
    color = sev_color.get(s["worst_severity"] or "", "#f9a825" if s["checks_not_run"] else "#2e7d32")
    cov_rows = "".join(
        f'<tr><td>{e(c["check"])}</td><td>{e(c["status"].replace("_", " "))}</td><td>{e(c["reason"])}</td></tr>'
        for c in s["coverage"] if c["status"] != "ran" or c["reason"])
    coverage = ("<h2>Checks that could not run, or ran with limits</h2><table class='t'><tr><th>check</th>"
                f"<th>status</th><th>why</th></tr>{cov_rows}</table>") if cov_rows else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ranksight diagnose {e(s['run_id'])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}}
.verdict{{padding:.8em;border-left:8px solid {color};background:#f5f5f5;font-weight:bold}}
.f{{margin:1em 0;padding:.5em;border:1px solid #ddd}} .sev{{color:#fff;padding:0 .4em;border-radius:3px}}
.meta{{color:#666;font-size:90%}} .rec{{color:#2e7d32}} table.ev td{{font-size:85%;padding:0 .6em 0 0;font-family:monospace}}
table.t{{border-collapse:collapse}} table.t td,table.t th{{border:1px solid #ccc;padding:.2em .5em}} .sim{{color:#8e24aa}}
</style></head><body>
<h1>ranksight diagnose: {e(s['run_id'])}</h1>
<p>ranks {len(s['ranks'])} on {len(s['nodes'])} node(s), steps {s['steps'][0]}-{s['steps'][1]},
layout {e(json.dumps(s['layout']))}, source {e(s['source'])}; peak: {e(s['peak'])}</p>
<div class="verdict">{e(s['verdict'])}</div>
<h2>Findings</h2>{''.join(items) or '<p>No findings.</p>'}
{coverage}
<h2>Compute time per rank and step</h2><p>colour: the rank's compute time against the median rank of that step
(green &lt;1.05x, amber &lt;1.15x, orange &lt;1.5x, red above)</p>{_svg_heat(report)}
<h2>Over time</h2>{plots}
{faults}
{hist_html}
{traces}
{sim}
</body></html>
"""
