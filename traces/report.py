"""The report of ``ranksight trace``: JSON, text (rich, fits 80 columns) and a self-contained HTML page.

JSON: ``{"verdict", "ranks": [per-rank figures of breakdown.analyse_rank], "kernel_spread", "slowest_collective",
"findings": [Finding], "notes", "errors", "diff"?}``.
"""

from __future__ import annotations

import html
import io
from typing import Any

import msgspec

from ranksight.schema import Finding


def _np(o: Any) -> Any:
    """numpy scalars in evidence -> Python numbers."""
    if hasattr(o, "item"):
        return o.item()
    raise NotImplementedError(type(o))


def build(ranks: list[dict[str, Any]], findings: list[Finding], extra: dict[str, Any], notes: list[str],
          errors: dict[str, str], diff: dict[str, Any] | None = None) -> dict[str, Any]:
    worst = [f for f in findings if f.severity in ("critical", "warning")]
    if not ranks:
        verdict = "no trace could be read"
    elif worst:
        verdict = "; ".join(f.summary for f in worst[:2])
    else:
        verdict = f"{len(ranks)} rank(s) read, nothing wrong found"
    out = {"verdict": verdict, "ranks": ranks, **extra, "findings": [msgspec.to_builtins(f, enc_hook=_np) for f in findings],
           "notes": notes, "errors": errors}
    if diff is not None:
        out["diff"] = diff
    return out


def to_json(report: dict[str, Any]) -> str:
    return msgspec.json.encode(report, enc_hook=_np).decode()


def _short(name: str, n: int = 38) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def to_text(report: dict[str, Any], width: int = 80) -> str:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    # text from the traces (kernel names, verdicts, "[warning]") is printed as text, never read as rich markup
    con.print(Text(report["verdict"], style="bold"))
    if report["ranks"]:
        w = report["ranks"][0]["window"]
        tb = Table(title=f"temporal breakdown, ms (window: {w['policy']})", width=width)
        for c in ("rank", "window", "compute", "comm", "memcpy", "memset", "idle", "ovl%"):
            tb.add_column(c, justify="right")
        for r in report["ranks"]:
            t = r["temporal"]
            tb.add_row(str(r["rank"]), f"{t['window_ms']:.2f}", f"{t['compute_ms']:.2f}", f"{t['comm_ms']:.2f}",
                       f"{t['memcpy_ms']:.2f}", f"{t['memset_ms']:.2f}", f"{t['idle_ms']:.2f}",
                       f"{100 * r['overlap']['overlap_ratio']:.0f}")
        con.print(tb)
        ti = Table(title="idle time, ms; launches", width=width)
        for c in ("rank", "host wait", "kernel wait", "other", "no launch", "delay p50"):
            ti.add_column(c, justify="right")
        for r in report["ranks"]:
            g = r["idle"]["gpu"]
            ln = r["launch"]
            ti.add_row(str(r["rank"]), f"{g['host_wait_ms']:.2f}", f"{g['kernel_wait_ms']:.2f}",
                       f"{g['other_ms']:.2f}", str(ln["without_launch"]), f"{ln.get('launch_delay_p50_ms', 0):.3f}")
        con.print(ti)
    spread = report.get("kernel_spread") or []
    if spread:
        tk = Table(title="top kernels over ranks, ms", width=width)
        for c in ("kernel", "total", "min", "max", "spread%"):
            tk.add_column(c, justify="right" if c != "kernel" else "left")
        for k in spread[:8]:
            tk.add_row(Text(_short(k["name"])), f"{k['total_ms']:.1f}", f"{k['min_ms']:.1f}",
                       f"{k['max_ms']:.1f} r{k['max_rank']}", f"{k['spread_pct']:.1f}")
        con.print(tk)
    for f in report["findings"]:
        con.print(Text(f"[{f['severity']}] {f['kind']} ranks {f['ranks']}: {f['summary']}"))
    d = report.get("diff")
    if d:
        con.print(Text(f"diff: {d['verdict']}"))
        for r in d["phases"]:
            pct = f"{r['delta_pct']:+.1f}%" if r["delta_pct"] is not None else ""
            con.print(Text(f"  {r['name']:<8} {r['base_ms']:>10.3f} -> {r['new_ms']:>10.3f} ms {pct}"))
        for r in d["kernels"][:5]:
            con.print(Text(f"  {_short(r['name'], 44):<44} {r['delta_ms']:+.3f} ms"))
    for n in report["notes"]:
        con.print(Text(f"note: {n}"))
    for p, e in report["errors"].items():
        con.print(Text(f"error: {p}: {e}"))
    return buf.getvalue()


def to_html(report: dict[str, Any]) -> str:
    """One page, no external resources: the text report's tables, findings with evidence, the JSON."""
    e = html.escape
    rows = []
    for r in report["ranks"]:
        t = r["temporal"]
        rows.append("<tr>" + "".join(f"<td>{e(str(x))}</td>" for x in (
            r["rank"], t["window_ms"], t["compute_ms"], t["comm_ms"], t["memcpy_ms"], t["memset_ms"], t["idle_ms"],
            r["overlap"]["overlap_ratio"])) + "</tr>")
    finds = "".join(f"<li><b>{e(f['severity'])}</b> {e(f['kind'])} ranks {e(str(f['ranks']))}: {e(f['summary'])}"
                    f"<pre>{e(msgspec.json.format(msgspec.json.encode(f['evidence'], enc_hook=_np)).decode())}</pre></li>"
                    for f in report["findings"])
    notes = "".join(f"<li>{e(n)}</li>" for n in report["notes"])
    data = e(msgspec.json.format(to_json(report).encode()).decode())
    return ("<!doctype html><html><head><meta charset='utf-8'><title>ranksight trace</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:2px 6px;text-align:right}pre{background:#f6f6f6;padding:4px}</style></head><body>"
            f"<h1>ranksight trace</h1><p><b>{e(report['verdict'])}</b></p><h2>Temporal breakdown (ms)</h2><table>"
            "<tr><th>rank</th><th>window</th><th>compute</th><th>comm</th><th>memcpy</th><th>memset</th><th>idle</th>"
            f"<th>overlap</th></tr>{''.join(rows)}</table><h2>Findings</h2><ul>{finds or '<li>none</li>'}</ul>"
            f"<h2>Notes</h2><ul>{notes}</ul><details><summary>JSON</summary><pre>{data}</pre></details></body></html>")


__all__ = ["build", "to_json", "to_text", "to_html"]
