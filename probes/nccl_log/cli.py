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


def _fmt_ranks(rs: list[int]) -> str:
    return ",".join(str(r) for r in rs) if rs else "-"


def _render(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:  # piped: don't squeeze the tables into 80 columns
        con = Console(width=200)
    con.print(f"[bold]NCCL logs[/bold]: {len(s['files'])} file(s), {s['lines']} lines, {s['events']} events "
              f"({s['categories'].get('unclassified', 0)} unclassified)")
    if s["versions"]:
        t = Table(title="NCCL versions")
        t.add_column("version")
        t.add_column("processes")
        for v, procs in s["versions"].items():
            t.add_row(v, ", ".join(procs[:8]) + (" ..." if len(procs) > 8 else ""))
        con.print(t)
    if s["processes"]:
        t = Table(title=f"Ranks ({len(s['ranks'])}) and hosts ({len(s['hosts'])})")
        for c in ("rank", "nranks", "host", "pid", "cudaDev", "busId", "version"):
            t.add_column(c)
        for p in sorted(s["processes"], key=lambda p: (p["rank"] is None, p["rank"] or 0, p["host"]))[:_MAX_ROWS]:
            t.add_row(*("-" if p[c] is None else str(p[c]) for c in ("rank", "nranks", "host", "pid", "cudaDev", "busId", "version")))
        con.print(t)
    if s["comms"]:
        t = Table(title="Communicators")
        for c in ("commId", "nranks", "ranks seen", "init complete", "channels", "rings", "trees", "init time s"):
            t.add_column(c)
        for cid, c in list(s["comms"].items())[:_MAX_ROWS]:
            times = list(c["init_time_s"].values())
            t.add_row(cid, str(c["nranks"] or "-"), _fmt_ranks(c["ranks_seen"]), _fmt_ranks(c["init_complete"]),
                      str(c["nchannels"] or "-"), str(len(c["rings"]) + len(c["ring_neighbors"])), str(len(c["trees"])),
                      f"{max(times):.2f}" if times else "-")
        con.print(t)
    if s["transports"]:
        t = Table(title="Transports per peer pair " + ", ".join(f"{k}: {v}" for k, v in s["transport_counts"].items()))
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
        t = Table(title="Networks and plugins")
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
        t = Table(title=f"{title} ({len(items)})", title_style=style)
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
        typer.echo(json.dumps(s, default=str))
    else:
        _render(s)
    if not s["files"]:
        raise typer.Exit(1)
