"""The diagnose report as one self-contained HTML page people share: inline CSS and SVG plots (matplotlib, drawn in
``analyzers.report.plots``), no script, no external asset; light and dark (``prefers-color-scheme``), readable at
1280 px, printable (plots never cut across pages).

Order: what it is (layout in words), the verdict, what to do next, the findings (evidence as sentences; the loss /
grad-norm / loss-scale curves beside an fp16 finding), the checks that could not run, the plots (each time axis marks
the injected faults, the findings' onsets and what happened to the job, numbered in one legend), the injected faults
against what was found, the job's history, the profiler windows.
"""

from __future__ import annotations

import html
import math

from analyzers.report.model import (TRACE_COLUMNS, DiagnoseReport, HeatView, fault_magnitude, fault_target, history_rows,
                                    layout_words, next_steps, trace_rows, trace_rows_note, trace_title)
from analyzers.report.sentences import evidence_sentences, plain_items

HEAT_COLORS = [(1.05, "#2e7d32"), (1.15, "#f9a825"), (1.5, "#ef6c00"), (float("inf"), "#c62828")]
SEV_COLOR = {"critical": "#c62828", "warning": "#e0a100", "info": "#1565c0"}
EVENT_KIND_WORDS = {"fault": "injected fault (ground truth)", "finding": "a finding's onset", "evict": "eviction",
                    "restart": "restart", "checkpoint": "checkpoint", "profile": "profiler capture", "action": "action"}
TRACE_PAGE_ROWS = 128  # a capture window's table on the page: more ranks than this, the ones furthest above the median
e = html.escape

CSS = """
:root{--fg:#1d1d1f;--muted:#5f6368;--bg:#ffffff;--card:#f6f7f9;--line:#d0d4da;--accent:#1565c0;--ok:#2e7d32;
--plotbg:#ffffff;color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--fg:#e8eaed;--muted:#a0a6ad;--bg:#16181b;--card:#202328;--line:#3a3f45;
--accent:#8ab4f8;--ok:#81c995;--plotbg:#f4f5f7}}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:1.5em 2em;max-width:1200px;
color:var(--fg);background:var(--bg);line-height:1.45}
h1{font-size:1.5em;margin:.2em 0} h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid var(--line)}
h3{font-size:1em;margin:1.2em 0 .3em}
.meta,.muted,figcaption{color:var(--muted);font-size:90%}
.verdict{padding:.8em 1em;border-left:8px solid var(--vcolor);background:var(--card);font-weight:600;border-radius:4px}
.f{margin:1em 0;padding:.7em 1em;border:1px solid var(--line);border-radius:6px;background:var(--card)}
.sev{color:#fff;padding:0 .45em;border-radius:3px;font-size:85%;text-transform:uppercase;letter-spacing:.03em}
.ev p{margin:.35em 0} .rec{color:var(--ok);margin-top:.4em}
details{margin-top:.4em} details summary{cursor:pointer;color:var(--muted);font-size:90%}
details table td{font-size:85%;padding:.1em .8em .1em 0;vertical-align:top}
table.t{border-collapse:collapse;margin:.4em 0} table.t td,table.t th{border:1px solid var(--line);padding:.25em .55em;
text-align:left;vertical-align:top} table.t th{background:var(--card)}
figure{margin:1em 0;break-inside:avoid;page-break-inside:avoid}
.plot-svg{display:block;width:100%;height:auto;max-width:1100px;background:var(--plotbg);border-radius:6px;padding:4px}
.plot-svg *{stroke-linejoin:round;stroke-linecap:butt} .heat text{fill:currentColor}
ol.next li{margin:.3em 0} ol.events{columns:2;font-size:90%} .missing{color:var(--muted);font-style:italic}
.ev-fault{color:#d32f2f} .ev-finding{color:#ef6c00} .ev-evict,.ev-restart{color:#8e24aa} .ev-checkpoint,.ev-profile,.ev-action{color:#607d8b}
.sim{color:#8e24aa;font-weight:600} .found{color:var(--ok)} .missed{color:#c62828;font-weight:700}
@media print{body{max-width:none;padding:0;font-size:10pt;background:#fff;color:#000}
.f,.verdict,table.t th{background:#fff} figure,.f,table.t tr{break-inside:avoid;page-break-inside:avoid}
.plot-svg{max-width:100%;padding:0} h2{break-after:avoid;page-break-after:avoid} ol.events{columns:1}}
"""


def _svg_heat(hv: HeatView) -> str:
    heat, spans, med = hv.rows, hv.spans, hv.median
    if heat.empty:
        return ""
    cw, ch, top = max(4, min(16, 900 // max(len(heat.columns), 1))), 14, 20
    left = 56 if not hv.others else 96
    w = left + cw * len(heat.columns) + 10
    h = top + ch * len(heat.index) + 20
    parts = [f'<svg class="heat" id="plot-heat" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" '
             f'height="{h}" role="img" aria-label="compute per rank and step">',
             f'<text x="{left}" y="14" font-size="11">steps {spans[0][0]} to {spans[-1][1]}</text>']
    for i, r in enumerate(heat.index):
        label = hv.labels[r]
        parts.append(f'<text x="2" y="{top + i * ch + 11}" font-size="10">{e(label)}</text>')
        for j, c in enumerate(heat.columns):
            v = heat.loc[r, c]
            ratio = v / med[c] if med[c] and math.isfinite(v) else float("nan")
            color = "#9e9e9e" if not math.isfinite(ratio) else next(col for lim, col in HEAT_COLORS if ratio < lim)
            a, b = spans[j]
            tip = (f"{label} steps {a}-{b}: {v:.1f} ms ({ratio:.2f}x median)" if math.isfinite(ratio)
                   else f"{label} steps {a}-{b}: no value")
            parts.append(f'<rect x="{left + j * cw}" y="{top + i * ch}" width="{cw}" height="{ch - 1}" fill="{color}">'
                         f'<title>{e(tip)}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def _figure(fig_id: str, title: str, svg: str, caption: str) -> str:
    return (f'<figure id="{fig_id}"><h3>{e(title)}</h3>{svg}<figcaption>{e(caption)}</figcaption></figure>')


def _many_note(n: int, what: str, which: str = "those the findings name first, then the most out of line") -> str:
    """The caption's words for a plot of more series than it draws one by one (plots.MANY)."""
    from analyzers.report import plots as P

    if n <= P.MANY:
        return ""
    return (f" Of {n} {what}, {P.FOCUS_K} are drawn one by one ({which}); the grey band is the others' 5th to 95th "
            "percentile per step, the grey line their median.")


def _missing(fig_id: str, title: str, why: str) -> str:
    return f'<p class="missing" id="missing-{fig_id}">{e(title)}: left out, {e(why)}.</p>'


def _finding(f: dict, training_fig: str) -> str:
    sentences, rest = evidence_sentences(f)
    where = []
    if f["ranks"]:
        where.append(("rank " if len(f["ranks"]) == 1 else "ranks ") + ", ".join(map(str, f["ranks"])))
    if f["nodes"]:
        where.append(("node " if len(f["nodes"]) == 1 else "nodes ") + ", ".join(map(str, f["nodes"])))
    if f.get("hosts"):
        where.append("hosts " + ", ".join(f["hosts"]))
    if f["step_start"] is not None:
        end = f["step_end"] if f["step_end"] is not None else "the end"
        where.append(f"steps {f['step_start']} to {end}" if end != f["step_start"] else f"step {f['step_start']}")
    where.append(f"confidence {f['confidence']:.0%}")
    body = "".join(f"<p>{e(s)}</p>" for s in sentences)
    items = plain_items(rest)
    details = ""
    if items:
        rows = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in items)
        label = "how it was measured" if sentences else "the evidence"
        details = f"<details><summary>{label} ({len(items)} more value{'s' if len(items) != 1 else ''})</summary><table>{rows}</table></details>"
    beside = training_fig if f["kind"] == "fp16_overflow" else ""
    rec = f'<div class="rec">&rarr; {e(f["recommendation"])}</div>' if f.get("recommendation") else ""
    return (f'<div class="f finding-{e(f["kind"])}"><span class="sev" style="background:{SEV_COLOR.get(f["severity"], "#666")}">'
            f'{e(f["severity"])}</span> <b>{e(f["kind"].replace("_", " "))}</b>: {e(f["summary"])}'
            f'{" <i>(simulated)</i>" if f["simulated"] else ""}<div class="meta">{e(" · ".join(where))}</div>'
            f'<div class="ev">{body}</div>{details}{beside}{rec}</div>')


def _plots(report: DiagnoseReport) -> tuple[str, str]:
    """(the plots section, the training-curves figure: drawn beside an fp16 finding when there is one)."""
    from analyzers.report import plots as P  # matplotlib: only when a page is drawn, not for the text or JSON report

    pdata, s = report.plots, report.summary
    ev = pdata.events
    steps = (int(s["steps"][0]), int(s["steps"][1]))
    out = []
    if ev:
        items = "".join(f'<li class="ev-{e(x.kind)}" id="event-{i + 1}">step {x.step}: {e(x.label)}</li>'
                        for i, x in enumerate(ev))
        kinds = sorted({x.kind for x in ev})
        out.append("<p>Marks on every time axis (the numbers at the top of each plot): "
                   + ", ".join(f'<span class="ev-{k}">{e(EVENT_KIND_WORDS.get(k, k))}</span>' for k in kinds)
                   + f'.</p><ol class="events">{items}</ol>')
    ser = report.over_time
    if not ser.empty:
        peak_sim = "simulated" in s["peak"].lower()
        what = "MFU" if ser["mfu"].notna().any() else "TFLOP/s (no peak known, so no MFU)"
        out.append(_figure("fig-throughput", f"{what} and step time per step", P.throughput_svg(ser, ev, peak_sim, steps),
                           f"Median over ranks per step. MFU is measured against {s['peak']}."))
    if not pdata.arrival_lag.empty:
        out.append(_figure("fig-arrival", "Arrival lag per rank at the gradient sync", P.arrival_svg(pdata.arrival_lag, ev, steps, pdata.focus_ranks),
                           f"How long after the step's first rank each rank arrived, from {pdata.arrival_source}. A rank "
                           "that arrives late every step is the one the others wait for." + _many_note(pdata.arrival_lag.shape[1], "ranks")))
    else:
        out.append(_missing("arrival", "Arrival lag per rank", pdata.missing.get("arrival", "no arrival times")))
    if not pdata.stacked.empty:
        out.append(_figure("fig-ranktime", "Where each rank's step goes", P.rank_time_svg(pdata.stacked, pdata.focus_ranks),
                           "Median over steps of each rank's compute, exposed communication (blocked in collectives), "
                           "data loading and pipeline wait, from the step records."
                           + (f" Of {len(pdata.stacked)} ranks: those the findings name and those with the longest steps, "
                              "then the ranks at the 95th percentile, the median and the 5th percentile of the others' "
                              "step totals, each labelled so." if len(pdata.stacked) > P.RANK_BARS else "")))
    else:
        out.append(_missing("ranktime", "Per-rank time split", pdata.missing.get("ranktime", "no time split")))
    hv = report.heat_view(120)
    heat = _svg_heat(hv)
    if heat:
        hv_others = hv.others
        rows_note = (f" {len(s['ranks']) - hv_others} ranks have their own row: those the findings name, then those "
                     f"most out of line with their step's median; the rows \"others' p95 / median / p5\" stand for the "
                     f"other {hv_others} ranks, per column." if hv_others else "")
        out.append(f'<figure id="fig-heat"><h3>{e(report.compute_label.capitalize())} per rank and step</h3>{heat}'
                   "<figcaption>Colour: the rank against the step's median rank (green under 1.05x, amber under 1.15x, "
                   f"orange under 1.5x, red above).{e(rows_note)}</figcaption></figure>")
    if pdata.gpu:
        sim = " The telemetry is SIMULATED (no real GPU)." if pdata.gpu_simulated else ""
        out.append(_figure("fig-gpu", "GPU SM clock and temperature per GPU" + (" (SIMULATED)" if pdata.gpu_simulated else ""),
                           P.gpu_svg(pdata.gpu, ev, pdata.gpu_simulated, steps, pdata.focus_nodes),
                           "Each GPU's samples mapped to the step whose time span they fall in, median per step." + sim
                           + _many_note(max(f.shape[1] for f in pdata.gpu.values()), "GPUs",
                                        "the lowest clocks and the hottest, the named nodes' first")))
    else:
        out.append(_missing("gpu", "GPU clock and temperature", pdata.missing.get("gpu", "no GPU samples")))
    training = ""
    if not pdata.training.empty:
        training = _figure("fig-training", "Loss, grad norm and loss scale", P.training_svg(pdata.training, pdata.overflow_steps, ev, steps),
                           "Median over ranks per step" + ("; red triangles: steps whose gradients overflowed (skipped)."
                                                           if pdata.overflow_steps else "."))
    has_fp16 = any(f["kind"] == "fp16_overflow" for f in s["findings"])
    if training and not has_fp16:
        out.append(training)
    elif not training:
        out.append(_missing("training", "Loss, grad norm and loss scale", pdata.missing.get("training", "no curves")))
    if not pdata.collectives.empty:
        out.append(_figure("fig-collectives", "Collective latency per group", P.collectives_svg(pdata.collectives, ev, steps),
                           "Per step and communicator: time from the last member's arrival to completion (the transfer "
                           "itself; waiting for a late rank is in the arrival lag plot), median over the step's ops."))
    else:
        out.append(_missing("collectives", "Collective latency per group", pdata.missing.get("collectives", "no collectives")))
    if pdata.pipeline:
        svg, bubble = P.pipeline_svg(pdata)
        stages = "; ".join(f"stage {st.stage}: {st.compute_ms:.0f} ms compute, {st.wait_ms:.0f} ms pipeline wait per step"
                           for st in pdata.pipeline)
        bub = f" The replayed step idles {bubble:.0%} of the time." if math.isfinite(bubble) else ""
        out.append(_figure("fig-pipeline", f"Pipeline timeline, {len(pdata.pipeline)} stages × {pdata.microbatches} micro-batches",
                           svg, f"Replayed, not traced: each stage's median forward and backward time per step (step "
                           f"records) divided by {pdata.microbatches} micro-batches, laid out in the "
                           f"{pdata.pipeline_schedule} schedule's order"
                           + (" (interleaved virtual stages drawn as one)" if pdata.virtual_stages > 1 else "")
                           + f".{bub} Measured: {stages}."))
    else:
        out.append(_missing("pipeline", "Pipeline timeline", pdata.missing.get("pipeline", "no pipeline")))
    return "\n".join(out), training if has_fp16 else ""


def _faults(report: DiagnoseReport) -> str:
    s = report.summary
    if not s["faults"]:
        return ""
    rows = []
    for r in s["faults"]:
        fl = r["fault"]
        end = fl.get("end")
        steps = f"{fl.get('start', 0)} to {end}" if end is not None else f"{fl.get('start', 0)} to the end"
        if r["found"]:
            lat = r["latency_steps"]
            result = '<span class="found">found</span>' + (f", {lat} step{'s' if lat != 1 else ''} after onset" if lat is not None else "")
        else:
            result = '<span class="missed">MISSED</span>'
        rows.append(f'<tr><td>{e(fl["kind"].replace("_", " "))}</td><td>{e(fault_target(fl, report.rank_node))}</td>'
                    f'<td>{e(fault_magnitude(fl) or "-")}</td><td>{e(steps)}</td><td>{result}</td>'
                    f'<td>{e(r["finding"] or "-")}</td></tr>')
    return ("<h2 id='faults'>Injected faults (ground truth) against what was found</h2><table class='t'><tr><th>fault</th>"
            "<th>where</th><th>how strong</th><th>steps</th><th>result</th><th>finding</th></tr>" + "".join(rows) + "</table>")


def render_html(report: DiagnoseReport) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG plots, no script, no external assets)."""
    s = report.summary
    plots, training = _plots(report)
    findings = "".join(_finding(f, training) for f in s["findings"]) or "<p>No findings.</p>"
    recs = next_steps(s)
    nxt = ("<ol class='next'>" + "".join(f"<li>{e(r)}</li>" for r in recs) + "</ol>" if recs
           else "<p>Nothing to fix. Keep this report as a baseline for the next run.</p>")
    hist, hist_html = s["history"], ""
    if len(hist["attempts"]) > 1 or hist["actions"]:
        rows = "".join("<tr>" + "".join(f"<td>{e(c or '-')}</td>" for c in cells) + "</tr>" for cells in history_rows(hist))
        hist_html = ("<h2 id='history'>What happened to the job</h2><table class='t'><tr><th>when</th><th>what</th><th>by</th>"
                     f"<th>detail</th></tr>{rows}</table>")
    traces = "".join(
        f"<h2>{e(trace_title(w))}</h2><table class='t'><tr>{''.join(f'<th>{e(c)}</th>' for c in TRACE_COLUMNS)}</tr>"
        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>" for cells in trace_rows(w, TRACE_PAGE_ROWS))
        + "</table>" + (f"<p class='muted'>{e(trace_rows_note(w, TRACE_PAGE_ROWS))}</p>" if len(w["ranks"]) > TRACE_PAGE_ROWS else "")
        for w in s["traces"])
    sim = ('<p class="sim">Parts of this report rest on SIMULATED telemetry or a CPU-measured peak; they are marked '
           '(simulated).</p>' if s["simulated"] else "")
    color = SEV_COLOR.get(s["worst_severity"] or "", "#e0a100" if s["checks_not_run"] else "#2e7d32")
    cov_rows = "".join(
        f'<tr><td>{e(c["check"])}</td><td>{e(c["status"].replace("_", " "))}</td><td>{e(c["reason"] or "-")}</td></tr>'
        for c in s["coverage"] if c["status"] != "ran" or c["reason"])
    coverage = ("<h2 id='coverage'>Checks that could not run, or ran with limits</h2><table class='t'><tr><th>check</th>"
                f"<th>status</th><th>why</th></tr>{cov_rows}</table>") if cov_rows else ""
    quality = []
    if s["truncated_lines"] or s["bad_lines"]:
        quality.append(f"{s['truncated_lines']} truncated and {s['bad_lines']} unreadable record line(s) were skipped.")
    if s.get("damaged_parts"):
        quality.append(f"{s['damaged_parts']} damaged store part file(s) were skipped: their rows are missing.")
    errors = "".join(f"<p class='missed'>analyzer error: {e(x.splitlines()[0] if x else '')}</p>" for x in s["analyzer_errors"])
    platform = f", {report.platform}" if report.platform else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>ranksight diagnose {e(s['run_id'])}</title>
<style>{CSS}:root{{--vcolor:{color}}}</style></head><body>
<h1>ranksight diagnose: {e(s['run_id'])}</h1>
<p class="layout" id="layout">{e(layout_words(s))}, steps {s['steps'][0]} to {s['steps'][1]}{e(platform)}; records from the
{e(s['source'])}. Peak: {e(s['peak'])}.</p>
{''.join(f'<p class="missed">{e(q)}</p>' for q in quality)}
<div class="verdict" id="verdict">{e(s['verdict'])}</div>
<h2 id="next">What to do next</h2>{nxt}
<h2 id="findings">Findings</h2>{findings}
{coverage}
<h2 id="plots">How the run went</h2>
{plots}
{_faults(report)}
{hist_html}
{traces}
{sim}{errors}
</body></html>
"""
