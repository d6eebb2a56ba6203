"""``ranksight runs``: list the runs in a store (from run.json and the steps table; no head needed)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import typer

from ranksight import schema

runs_command = typer.Typer(add_completion=False, help="List the runs in a store.")

# A run with no new step for this long and no `finished` in its manifest is shown as "stopped".
STALE_S = 60.0


def _steps_summary(run_root: Path) -> tuple[int | None, int | None, float | None, str]:
    """(steps recorded, last step, last step end time, source) from the store table, else the spools."""
    from ranksight.store_layout import table_files

    # the files the store's reader reads (Hive partitions and flat parts; not those a compacted file replaced); those
    # a head moved to object storage are left out here: this listing needs no credentials nor network
    files = [f.path for f in table_files(run_root / "steps", include_remote=False)]
    if files:
        import duckdb

        con = duckdb.connect()
        try:
            n, last, t = con.execute(
                "select count(*), max(step), max(t_end) from read_parquet(?)", [files]
            ).fetchone()
        finally:
            con.close()
        return int(n), (int(last) if last is not None else None), t, "store"
    spool = run_root / "spool"
    if spool.is_dir():
        n, last, t = 0, None, None
        for p in spool.glob("rank-*.jsonl"):
            with open(p, "rb") as f:
                for line in f:
                    if b'"kind":"step"' not in line:
                        continue
                    try:
                        rec = schema.decode_spool_line(line)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    n += 1
                    last = rec.step if last is None else max(last, rec.step)
                    t = rec.t_end if t is None else max(t, rec.t_end)
        return n, last, t, "spool"
    return None, None, None, "-"


def list_runs(store: Path) -> list[dict[str, Any]]:
    out = []
    if not store.is_dir():
        return out
    now = time.time()
    for d in sorted(store.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        man_path = d / "run.json"
        if not man_path.exists() and not (d / "steps").is_dir() and not (d / "spool").is_dir():
            continue
        m = None
        problem = ""
        if man_path.exists():
            try:
                m = msgspec.json.decode(man_path.read_bytes(), type=schema.Manifest)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                problem = f"run.json unreadable: {e}"
        try:
            n, last, t_last, source = _steps_summary(d)
        except Exception as e:  # a damaged part file must not hide the other runs
            n, last, t_last, source = None, None, None, "-"
            problem = problem or f"steps unreadable: {e}"
        if problem:
            status = "damaged"
        elif m is not None and m.finished:
            status = "finished"
        elif t_last is not None and now - t_last < STALE_S:
            status = "running"
        elif n:
            status = "stopped"
        else:
            status = "empty"
        layout = m.layout if m else {}
        out.append({
            "run_id": d.name,
            "start_time": m.start_time if m else None,
            "layout": " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp") if k in layout) or "-",
            "world_size": (layout.get("world") or len(m.ranks) or None) if m else None,
            "nodes": m.nodes if m else None,
            "steps_recorded": n,
            "last_step": last,
            "source": source,
            "status": status,
            "problem": problem,  # why a run is "damaged" ("" otherwise)
        })
    return out


# Columns of the table, the least useful first to go when the terminal is narrow (--json always has them all).
RUNS_DROP_ORDER = ("nodes", "layout", "world", "started (UTC)")


def runs_table(store: Path, rows: list[dict[str, Any]], console) -> tuple[Any, list[str]]:
    """The rich table of ``rows`` fitted to ``console``'s width, and the columns it had to leave out."""
    from ranksight.fit_table import Col, fit_table

    cols = [Col("run id"), Col("started (UTC)"), Col("layout"), Col("world", "right"),
            Col("nodes", "right"), Col("steps", "right"), Col("last step", "right"), Col("status")]
    body = []
    for r in rows:
        started = (datetime.fromtimestamp(r["start_time"], timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                   if r["start_time"] else "-")
        steps = "-" if r["steps_recorded"] is None else f"{r['steps_recorded']}" + (" (spool)" if r["source"] == "spool" else "")
        body.append([r["run_id"], started, r["layout"], str(r["world_size"] or "-"), str(r["nodes"] or "-"), steps,
                     "-" if r["last_step"] is None else str(r["last_step"]), r["status"]])
    fitted = fit_table(console, cols, body, RUNS_DROP_ORDER, title=f"runs in {store}")
    return fitted.table, fitted.dropped


@runs_command.command()
def runs(
    store: Path = typer.Option(Path("./runs"), "--store", help="Run store directory."),
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object, {"store", "runs": [...]}, instead of '
                                                       'a table.'),
) -> None:
    """List the runs in a store: id, start, layout, world size, steps recorded, last step, status. Exit 1 when there
    is no store at --store (with --json: {"error": ..., "runs": []})."""
    from rich.console import Console

    from ranksight.fit_table import dropped_note

    if not store.is_dir():
        if as_json:
            typer.echo(json.dumps({"store": str(store), "error": f"no store at {store} (use --store DIR)", "runs": []}))
        else:
            typer.echo(f"no store at {store} (use --store DIR)", err=True)
        raise typer.Exit(1)
    rows = list_runs(store)
    if as_json:
        typer.echo(json.dumps({"store": str(store), "runs": rows}, indent=2))
        return
    if not rows:
        typer.echo(f"no runs in {store}")
        return
    console = Console()
    table, dropped = runs_table(store, rows, console)
    console.print(table)
    # a damaged run's reason, whole, under the table rather than squeezed into its status cell
    for r in rows:
        if r["problem"]:
            console.print(f"{r['run_id']}: {r['problem']}", markup=False, highlight=False)
    if dropped:
        console.print(dropped_note(dropped, console.width), markup=False, highlight=False)
