"""``ranksight nccl-log FILE... [--json]``: what the NCCL parser finds in logs a user already has.

Works on any cluster's logs, not only ours: per-process NCCL_DEBUG_FILE outputs, pasted
snippets, or a job's whole stdout. Unreadable files get one error line each; the exit code
is 1 only when nothing at all could be read.
"""

from __future__ import annotations

import json
import os
from typing import Any

import typer

from probes.nccl_log.summary import summarize

_MAX_ROWS = 40  # per table; the JSON output is complete
# Columns dropped first when a table is wider than the terminal (--json has them all): identifiers a reader rarely
# needs next to the ranks, hosts, transports and errors.
DROP_ORDER = ("busId", "cudaDev", "pid", "version", "PXN", "GDR", "dir", "channels", "rings", "trees", "init time s",
              "where", "host:pid", "nranks")


def _fmt_ranks(rs: list[int]) -> str:
    """Ranks as ranges, ``0-7, 9, 12-15``: short, and a narrow column wraps between ranges, never inside a number."""
    if not rs:
        return "-"
    out: list[str] = []
    rs = sorted(set(rs))
    start = prev = rs[0]
    for r in rs[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


class FittedTable:
    """A table printed fitted to its console: every value whole, the columns in DROP_ORDER left out (and named) while
    it is too wide. Collects columns and rows as ``rich.table.Table`` does."""

    def __init__(self, title: str, title_style: str | None = None):
        self.title, self.title_style, self.cols, self.rows = title, title_style, [], []

    def add_column(self, header: str, **_kw) -> None:
        from ranksight.fit_table import Col

        self.cols.append(Col(header))

    def add_row(self, *cells) -> None:
        self.rows.append(list(cells))

    def __rich_console__(self, console, options):
        from ranksight.fit_table import dropped_note, fit_table

        fitted = fit_table(console, self.cols, self.rows, DROP_ORDER, width=options.max_width, title=self.title,
                           title_style=self.title_style)
        yield fitted.table
        if fitted.dropped:
            yield dropped_note(fitted.dropped, options.max_width)


def render_tables(s: dict[str, Any], con=None) -> None:
    from rich.console import Console

    if con is None:
        con = Console()
        if not con.is_terminal and not os.environ.get("COLUMNS"):  # piped: do not squeeze the tables into 80 columns
            con = Console(width=200)


    con.print(f"[bold]NCCL logs[/bold]: {len(s['files'])} file(s), {s['lines']} lines, {s['events']} events "
              f"({s['categories'].get('unclassified', 0)} unclassified)")
    if s["versions"]:
        t = FittedTable(title="NCCL versions")
        t.add_column("version")
        t.add_column("processes")
        for v, procs in s["versions"].items():
            t.add_row(v, ", ".join(procs[:8]) + (" ..." if len(procs) > 8 else ""))
        con.print(t)
    if s["processes"]:
        t = FittedTable(title=f"Ranks ({len(s['ranks'])}) and hosts ({len(s['hosts'])})")
        for c in ("rank", "nranks", "host", "pid", "cudaDev", "busId", "version"):
            t.add_column(c)
        for p in sorted(s["processes"], key=lambda p: (p["rank"] is None, p["rank"] or 0, p["host"]))[:_MAX_ROWS]:
            t.add_row(*("-" if p[c] is None else str(p[c]) for c in ("rank", "nranks", "host", "pid", "cudaDev", "busId", "version")))
        con.print(t)
    if s["comms"]:
        t = FittedTable(title="Communicators")
        for c in ("commId", "nranks", "ranks seen", "init complete", "channels", "rings", "trees", "init time s"):
            t.add_column(c)
        for cid, c in list(s["comms"].items())[:_MAX_ROWS]:
            times = list(c["init_time_s"].values())
            t.add_row(cid, str(c["nranks"] or "-"), _fmt_ranks(c["ranks_seen"]), _fmt_ranks(c["init_complete"]),
                      str(c["nchannels"] or "-"), str(len(c["rings"]) + len(c["ring_neighbors"])), str(len(c["trees"])),
                      f"{max(times):.2f}" if times else "-")
        con.print(t)
    if s["transports"]:
        t = FittedTable(title="Transports per peer pair " + ", ".join(f"{k}: {v}" for k, v in s["transport_counts"].items()))
        for c in ("comm", "src -> dst", "transport", "dir", "via", "GDR", "PXN", "channels"):
            t.add_column(c)
        for tr in s["transports"][:_MAX_ROWS]:
            t.add_row(tr["comm_id"][-10:], f"{tr['src']} -> {tr['dst']}", tr["transport"], tr["direction"] or "-",
                      tr["via"], "yes" if tr["gdrdma"] else "-", "yes" if tr["pxn"] else "-",
                      ",".join(str(x) for x in tr["channels"]))
        con.print(t)
        if len(s["transports"]) > _MAX_ROWS:
            con.print(f"  ... {len(s['transports']) - _MAX_ROWS} more (use --json)")
    if s["networks"] or s["plugins"]:
        t = FittedTable(title="Networks and plugins")
        t.add_column("kind")
        t.add_column("detail")
        for net, devs in s["networks"].items():
            t.add_row(f"NET/{net}", "; ".join(d for d in devs if d) or "-")
        for p in s["plugins"][:_MAX_ROWS]:
            t.add_row(f"plugin:{p['plugin']}", p["detail"])
        con.print(t)
    for title, key, style in (("Errors", "errors", "red"), ("Watchdog", "watchdog", "red"), ("Warnings", "warnings", "yellow")):
        items = s[key]
        if not items:
            continue
        t = FittedTable(title=f"{title} ({len(items)})", title_style=style)
        for c in ("class", "rank", "host:pid", "peer", "detail", "where"):
            t.add_column(c, overflow="fold")
        for e in items[:_MAX_ROWS]:
            peer = e.get("peer_addr") or (str(e["peer"]) if e.get("peer") is not None else "-")
            detail = e["message"]
            if e.get("status_name"):
                detail = f"{e['status_name']} (status {e['status']}): {detail}"
            t.add_row(e["error_class"] or e["category"], "-" if e["rank"] is None else str(e["rank"]),
                      f"{e['host']}:{e['pid']}", peer, detail[:300], f"{os.path.basename(e['file'])}:{e['line']}")
        con.print(t)
    for n in s["notes"]:
        con.print(f"[yellow]note:[/yellow] {n}")


nccl_log_command = typer.Typer(add_completion=False, help="Summarize NCCL_DEBUG=INFO logs a user already has.")


@nccl_log_command.command()
def nccl_log(
    files: list[str] = typer.Argument(..., help="NCCL_DEBUG=INFO log files (NCCL_DEBUG_FILE outputs, job stdout, .gz)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Summarize NCCL_DEBUG=INFO logs: versions, ranks, hosts, transports, rings/trees, errors with ranks and peers."""
    s = summarize(files)
    for path, err in s["file_errors"].items():
        typer.echo(f"ranksight nccl-log: cannot read {path}: {err}", err=True)
    if as_json:
        # "error": why nothing could be read (exit 1), else None; the unreadable files are in "file_errors"
        error = None if s["files"] else f"none of the {len(files)} file(s) could be read"
        typer.echo(json.dumps({"error": error, **s}, default=str))
    else:
        render_tables(s)
    if not s["files"]:
        raise typer.Exit(1)
