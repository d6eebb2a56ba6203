"""The logs report: its verdict, the JSON shape (``{"verdict", "exit_code", "inputs", "findings", "summaries",
"errors"}``), the terminal rendering and a self-contained HTML page."""

from __future__ import annotations

import html
import json
import os
from dataclasses import asdict
from typing import Any

from ranksight.exit_codes import EXIT, EXIT_HEALTHY, EXIT_INCOMPLETE, EXIT_LOAD_ERROR
from logs.analysis import LogReport
from ranksight.schema import to_dict


def exit_code(r: LogReport) -> int:
    """diagnose's codes: 0 nothing wrong, 10 nothing wrong but some input or reader failed or no input was in a known
    format (nothing judged is not healthy), 20 warning, 30 critical, 40 nothing could be read at all."""
    if not any(i.error is None for i in r.inputs):
        return EXIT_LOAD_ERROR
    code = EXIT[r.worst]
    nothing_known = not any(i.formats for i in r.inputs)
    if code == EXIT_HEALTHY and (nothing_known or r.errors or any(i.error for i in r.inputs)):
        return EXIT_INCOMPLETE
    return code


def verdict(r: LogReport) -> str:
    read = [i for i in r.inputs if i.error is None]
    if not read:
        return f"NOTHING READ: none of the {len(r.inputs)} input(s) could be read"
    understood = [i for i in read if i.formats]
    scope = f"{len(understood)} of {len(read)} input(s) understood, {sum(i.lines for i in read)} lines"
    worst = r.worst
    if worst in ("warning", "critical"):
        top = next(f for f in r.findings if f.severity == worst)
        n = sum(1 for f in r.findings if f.severity == worst)
        more = f" (+{n - 1} more {worst})" if n > 1 else ""
        return f"{worst.upper()}: {top.summary}{more} [{scope}]"
    if not understood:
        return f"NOTHING RECOGNISED: no known log format in {scope}"
    gaps = [i.path for i in r.inputs if i.error] + r.errors
    if gaps:
        return f"INCOMPLETE: no problems found, but {len(gaps)} input(s) or reader(s) failed [{scope}]"
    return f"HEALTHY: no problems found [{scope}]"


def as_dict(r: LogReport) -> dict[str, Any]:
    return {"verdict": verdict(r), "exit_code": exit_code(r), "inputs": [asdict(i) for i in r.inputs],
            "findings": [to_dict(f) for f in r.findings], "summaries": r.summaries, "errors": r.errors}


def to_json(r: LogReport) -> str:
    return json.dumps(as_dict(r), default=str)


def _where(f) -> str:
    parts = []
    if f.ranks:
        parts.append("ranks " + ",".join(map(str, f.ranks[:16])) + (" ..." if len(f.ranks) > 16 else ""))
    if f.hosts:
        parts.append("hosts " + ",".join(f.hosts[:8]) + (" ..." if len(f.hosts) > 8 else ""))
    if f.gpus:
        parts.append("GPUs " + ",".join(f.gpus[:8]) + (" ..." if len(f.gpus) > 8 else ""))
    if f.step_start is not None:
        parts.append(f"steps {f.step_start}-{f.step_end if f.step_end is not None else '?'}")
    return "; ".join(parts) or "-"


def _common_dir(paths: list[str]) -> str:
    """The directory every path lies under ("" when they share none, or there is one input)."""
    dirs = [os.path.dirname(p) for p in paths]
    if len(paths) < 2 or not all(dirs):
        return ""
    try:
        common = os.path.commonpath(dirs)
    except ValueError:  # absolute and relative paths mixed
        return ""
    return common if common not in ("", os.sep, ".") else ""


def _labelled(rows: list[tuple[str, str]]):
    """Label/value lines with a hanging indent: a value that wraps stays in its column, the label's stays clear."""
    from rich.table import Table
    from rich.text import Text

    g = Table.grid(padding=(0, 1))
    g.add_column(justify="right", width=15, no_wrap=True, style="dim")
    g.add_column(overflow="fold")
    for label, value in rows:
        g.add_row(label, Text(value))
    return g


def render_text(r: LogReport, console=None) -> None:
    """The verdict, the inputs understood (a table that fits the console: paths under their common directory, columns
    left out rather than values cut), then each finding with where, from, and what to do next."""
    from rich.console import Console
    from rich.text import Text

    from ranksight.fit_table import Col, dropped_note, fit_table

    con = console or Console()
    style = {"critical": "bold red", "warning": "yellow"}.get(r.worst or "", "green")
    con.print(Text(verdict(r), style=style))
    shown = [i for i in r.inputs if i.formats or i.error]  # the rest: one line (a run directory holds hundreds)
    if shown:
        base = _common_dir([i.path for i in r.inputs])
        rows = []
        for i in shown:
            fm = ", ".join(f"{k} {v}" for k, v in i.formats.items()) if i.error is None else Text(i.error, style="red")
            rows.append([os.path.relpath(i.path, base) if base else i.path, str(i.lines), fm or "-", str(i.unknown_lines)])
        if base:
            con.print(Text(f"Inputs under {base}{os.sep}", style="italic"), overflow="fold")
        cols = [Col("input"), Col("lines", "right"), Col("formats"), Col("unknown lines", "right")]
        fitted = fit_table(con, cols, rows, ("unknown lines", "lines"), title=None if base else "Inputs")
        con.print(fitted.table)
        if fitted.dropped:
            con.print(dropped_note(fitted.dropped, con.width), markup=False, highlight=False)
    rest = [i for i in r.inputs if not (i.formats or i.error)]
    if rest:
        con.print(f"{len(rest)} input(s) in no known format ({sum(i.lines for i in rest)} lines), e.g. "
                  f"{', '.join(i.path for i in rest[:3])}{' ...' if len(rest) > 3 else ''} (--json lists every input)",
                  highlight=False, markup=False)
    for f in r.findings:
        sev = {"critical": "bold red", "warning": "yellow"}.get(f.severity, "cyan")
        line = Text(f"{f.severity.upper():8}", style=sev)
        line.append(" ")
        line.append(f.kind, style="bold")
        line.append(f" {f.summary}")
        con.print(line)
        rows = [("where:", _where(f)),
                ("from:", ", ".join(f.inputs[:4]) + (" ..." if len(f.inputs) > 4 else ""))]
        if f.recommendation:
            rows.append(("next:", f.recommendation))
        con.print(_labelled(rows))
    for e in r.errors:
        con.print(Text("note: ", style="yellow") + Text(e))


def render_html(r: LogReport) -> str:
    e = html.escape
    rows = "".join(f"<tr><td>{e(i.path)}</td><td>{i.lines}</td><td>{e(', '.join(f'{k} {v}' for k, v in i.formats.items()) or (i.error or '-'))}"
                   f"</td><td>{i.unknown_lines}</td></tr>" for i in r.inputs)
    cards = []
    for f in r.findings:
        ev = "".join(f"<li><b>{e(str(k))}</b>: {e(json.dumps(v, default=str)[:400])}</li>" for k, v in f.evidence.items())
        cards.append(f'<section class="f {e(f.severity)}"><h3>{e(f.severity.upper())} · {e(f.kind)}</h3>'
                     f"<p>{e(f.summary)}</p><p class=m>{e(_where(f))} · from {e(', '.join(f.inputs))}</p>"
                     f"<ul>{ev}</ul>" + (f"<p><b>What to do next:</b> {e(f.recommendation)}</p>" if f.recommendation else "")
                     + "</section>")
    errs = "".join(f"<li>{e(x)}</li>" for x in r.errors)
    return ("<!doctype html><html><head><meta charset=utf-8><title>ranksight logs</title><style>"
            ":root{color-scheme:light dark}body{font:14px/1.45 system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
            "table{border-collapse:collapse}td,th{border:1px solid #8886;padding:.2em .5em;text-align:left}"
            ".f{border-left:6px solid #1565c0;padding:.3em 1em;margin:1em 0}.f.warning{border-color:#ef6c00}"
            ".f.critical{border-color:#c62828}.m{opacity:.75}</style></head><body>"
            f"<h1>ranksight logs</h1><p><b>{e(verdict(r))}</b></p><h2>Inputs</h2><table><tr><th>input</th><th>lines</th>"
            f"<th>formats</th><th>unknown lines</th></tr>{rows}</table><h2>Findings</h2>{''.join(cards) or '<p>none</p>'}"
            + (f"<h2>Notes</h2><ul>{errs}</ul>" if errs else "") + "</body></html>")
